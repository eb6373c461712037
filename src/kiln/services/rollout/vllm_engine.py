"""The vLLM engine: vLLM's `AsyncLLM` behind `Engine`, with exact per-token policy versions.

The version guarantee. `apply_weights` freezes the scheduler between two engine steps (vLLM's
`pause_generation(mode="keep")`: no step runs, in-flight requests stay queued), reloads the
weights in place, relabels the engine's weight version, and preempts every running request
(`reset_prefix_cache(reset_running_requests=True)`) before resuming. vLLM labels each step's
outputs with the weight version current when the step ran, and reports per-request version
spans; a preempted request is re-prefilled, so its KV cache is recomputed under the new weights.
Hence for every generated token: its recorded version is the version of the weights that
produced it, and its recorded log-prob is that version's log-prob of the token given the whole
preceding sequence (not a mix of old cached keys and new weights).

A version is applied whole or not at all. vLLM reloads in place, so a reload that failed
part-way would leave a mix no version names; every weight of a version is therefore checked
first against the checkpoint the engine started from (the same names, the same shapes,
floating point), and a version that does not match is refused before anything is touched: the
old one is served on. A reload that still fails after that check (an internal error, memory)
leaves the engine refusing to generate (`EngineBroken`); the rollout service exits and is
restarted on the latest version. Keeping a second copy of the weights to swap back was tried and
does not work here: vLLM's layer-wise reload keeps per-layer loading state that a failed
reload leaves behind, and a second reload trips over it.

Not covered: multi-GPU tensor parallelism, vLLM's own LoRA serving (a LoRA policy's versions are
merged into the base before they reach this engine: `lora_merge.py`).
"""
from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

from kiln.services.rollout.engine import (
    EngineBase, EngineBroken, EngineSettings, Generation, NamedTensors, SamplingOptions,
    TopKScores, check_sequence)
from kiln.services.rollout.wire import MAX_TOP_K


#: vLLM loads it by name in its engine process (see `tool_choice.py`).
TOOL_CHOICE_PROCESSOR = "kiln.services.rollout.tool_choice:ToolChoiceLogitsProcessor"


def _reload_in_worker(worker: Any, path: str) -> None:
    """Runs inside each vLLM worker: reload the weights in place from a safetensors file."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        worker.model_runner.reload_weights(
            weights_iterator=((name, f.get_tensor(name)) for name in f.keys()))
    _refresh_cpu_embedding_gemm(worker.model_runner.get_model())


def _refresh_cpu_embedding_gemm(model: Any) -> None:
    """On CPUs vLLM computes logits with a prepacked copy of the (LM-head) embedding weight,
    made when the model was loaded. An in-place reload updates the weight, but for a model with
    tied embeddings the LM head is the input embedding, whose prepacked copy the reload does not
    redo: logits would come from the old weights. Repack every embedding from its current weight
    (cheap: one matrix per embedding)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a Hugging Face checkpoint's safetensors files, read from
    their headers (no tensor is loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_version(version: int, named_tensors: NamedTensors,
                  shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, Any]]:
    """The tensors of `version`, if they are a whole version of the checkpoint `shapes`
    describes; ValueError naming what does not match otherwise (nothing applied yet). A tied
    LM head may be left out or put in: the checkpoint format allows it either way. With no
    shapes (a checkpoint not in safetensors) nothing can be checked."""
    tensors = list(named_tensors)
    if not shapes:
        return tensors
    names = {n for n, _ in tensors}
    unknown = sorted(names - set(shapes) - {"lm_head.weight"})
    if unknown:
        raise ValueError(f"version {version}: weights {unknown[:5]} are not in the served model; "
                         "old weights kept")
    missing = sorted(set(shapes) - names - {"lm_head.weight"})
    if missing:
        raise ValueError(f"version {version} lacks {missing[:5]} ({len(missing)} of "
                         f"{len(shapes)}); a part of a version is never applied; old weights kept")
    for name, t in tensors:
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise ValueError(f"version {version}: weight {name} has shape {tuple(t.shape)}, "
                             f"the served model's is {shapes[name]}; old weights kept")
    return tensors


def _write_weights(named_tensors: NamedTensors) -> str:
    # The weights go to the engine's workers (other processes on this host) through a file in
    # shared memory: vLLM's RPC path copies large arguments several times and does not
    # round-trip tensors nested in arguments.
    import tempfile

    import torch
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu", copy=False).contiguous() for name, t in named_tensors}
    for name, t in tensors.items():
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"weight {name} has dtype {t.dtype}; only floating-point weights load")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kiln-weights-", suffix=".safetensors", dir=shm)
    os.close(fd)
    try:
        save_file(tensors, path)
    except BaseException:
        os.unlink(path)
        raise
    return path


class VllmEngine(EngineBase):
    """vLLM AsyncLLM behind `Engine`. Create with `await VllmEngine.start(settings)` (~20 s on a
    CPU) and `await engine.close()` when done. Many `generate` calls may run at once."""

    def __init__(self, llm: Any, settings: EngineSettings, fingerprint: str) -> None:
        super().__init__(settings, fingerprint)
        self._llm = llm
        self._update_lock = asyncio.Lock()
        self._broken = ""  # why the engine must not generate again (see EngineBroken)
        self._shapes = checkpoint_shapes(settings.model)
        self._vocab: int | None = None
        from vllm.platforms import current_platform

        # On a CPU a seeded request whose prefill is split over steps kills the engine ("CPU
        # Generator does not use offset": vLLM rewinds the request's generator, which only a
        # CUDA generator can do); concurrent long prompts split prefills.
        self.honours_seeds = not current_platform.is_cpu()

    def failure(self) -> str:
        if self._broken:
            return self._broken
        if self._llm is not None and self._llm.errored:
            return f"the vLLM engine died ({self._llm.dead_error!r})"
        return ""

    @classmethod
    async def start(cls, settings: EngineSettings) -> "VllmEngine":
        # Reloading from in-memory tensors sends a function to the workers, which vLLM only
        # accepts with this set; it must be in the environment before the engine processes start.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        # Run the model inside vLLM's engine-core process ("uni" executor) rather than in a
        # worker process of its own: engine core and worker otherwise wait for each other by
        # spinning on shared memory, which on a CPU host burns about a core and a half that
        # the sandboxes and the trainer need. The CPU platform forces the multiprocess
        # executor unless this variable is 0; AsyncLLM keeps its engine core in a separate
        # process either way.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=settings.model, dtype=settings.dtype, seed=settings.seed,
            enforce_eager=settings.enforce_eager, kv_cache_memory_bytes=settings.kv_cache_bytes,
            max_model_len=settings.max_model_len, disable_log_stats=True,
            distributed_executor_backend="uni",
            max_logprobs=MAX_TOP_K,  # a teacher's top k for dense distillation
            # "processed": of the distribution sampled from (after temperature; greedy rows
            # keep the raw logits). Prompt log-probs (`score`) are raw in either mode.
            logprobs_mode="processed_logprobs" if settings.tempered_logprobs else "raw_logprobs",
            # Tool choices (`rollout.sampling.toolChoiceTemperature`); requests opt in.
            logits_processors=[TOOL_CHOICE_PROCESSOR],
        )
        llm = AsyncLLM.from_engine_args(args)
        await llm.update_weight_version(str(settings.initial_version))
        fingerprint = (f"vllm-{vllm.__version__}+torch-{torch.__version__};dtype={settings.dtype};"
                       f"seed={settings.seed};enforce_eager={settings.enforce_eager};"
                       f"logprobs={'tempered' if settings.tempered_logprobs else 'raw'}")
        return cls(llm, settings, fingerprint)

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingOptions) -> Generation:
        if self._broken:
            raise EngineBroken(self._broken)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from kiln.services.rollout.tool_choice import extra_args as tool_choice_args

        rule = sampling.tool_choice
        if rule is not None and not self.settings.tempered_logprobs:
            raise ValueError("sampling.tool_choice: this engine records raw log-probs, not the tool "
                             "choice's; start it with tempered_logprobs (EngineSettings.from_job "
                             "does for a job with toolChoiceTemperature)")
        params = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args=(tool_choice_args(rule.choices, sampling.temperature)
                        if rule is not None else None),
        )
        final = None
        async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
                                            params, request_id=uuid.uuid4().hex):
            final = out
        if final is None:
            raise RuntimeError("vLLM returned no output for a request (engine stopped?); retry may help")
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        logprobs = [entry[tok].logprob for entry, tok in zip(c.logprobs or [], token_ids)]
        versions = [-1] * len(token_ids)
        for span in c.weight_versions or []:
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
        if len(logprobs) != len(token_ids) or -1 in versions:
            raise RuntimeError(f"vLLM output lacks logprobs or weight versions for request "
                               f"{final.request_id}; this is a bug, not retryable")
        return Generation(token_ids, logprobs, versions, c.finish_reason or "abort")

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return [logp for logp, _, _ in await self.score_topk(sequences, 0)]

    async def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopKScores]:
        if self._broken:
            raise EngineBroken(self._broken)
        vocab = self._vocab_size()
        for seq in sequences:
            check_sequence(seq, vocab)
        # Concurrent requests: vLLM batches their prefills.
        return list(await asyncio.gather(*(self._score_one(list(s), k) for s in sequences)))

    def _vocab_size(self) -> int:
        if self._vocab is None:
            import json
            config = json.loads((Path(self.settings.model) / "config.json").read_text())
            self._vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        return self._vocab

    async def _score_one(self, seq: list[int], k: int) -> TopKScores:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # One token generated (vLLM generates at least one), the prompt's own log-probs kept:
        # prompt_logprobs=k returns the log-prob of each prompt token actually there and of
        # the k most likely in its place (ranked 1..k; the token itself may rank lower).
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self._llm.generate(TokensPrompt(prompt_token_ids=seq), params,
                                            request_id=uuid.uuid4().hex):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt log-probs (engine stopped?); retry may help")
        rows = final.prompt_logprobs
        sampled = [0.0, *(row[tok].logprob for row, tok in zip(rows[1:], seq[1:]))]
        ids, lps = [0] * k, [0.0] * k
        for row in rows[1:] if k else ():
            top = sorted((lp.rank, tid, lp.logprob) for tid, lp in row.items())[:k]
            if len(top) != k:
                raise RuntimeError(f"vLLM returned {len(top)} of the top {k} prompt log-probs; "
                                   "this is a bug, not retryable")
            ids += [tid for _, tid, _ in top]
            lps += [lp for _, _, lp in top]
        return sampled, ids, lps

    async def apply_weights(self, version: int, named_tensors: NamedTensors) -> None:
        async with self._update_lock:
            self.check_new_version(version)
            tensors = check_version(version, named_tensors, self._shapes)
            path = await asyncio.to_thread(_write_weights, tensors)
            llm = self._llm
            await llm.pause_generation(mode="keep", clear_cache=False)
            broken = False
            try:
                try:
                    await llm.collective_rpc(_reload_in_worker, kwargs={"path": path})
                except Exception as exc:
                    # Some weights may be the new version's already: a mix no version names.
                    # Generation stays paused for good rather than resume on it.
                    broken = True
                    self._broken = f"reloading version {version} failed part-way: {exc}"
                    raise EngineBroken(self._broken) from exc
                await llm.update_weight_version(str(version))
                # Running requests are preempted and re-prefilled under the new weights.
                await llm.reset_prefix_cache(reset_running_requests=True)
                self._switched_to(version)
            finally:
                if not broken:
                    await llm.resume_generation()
                os.unlink(path)

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
