"""The trainer engine: a Megatron-core policy model, its optimizer, and one call per step.

`TrainerEngine` holds the model (loaded from a Hugging Face checkpoint, tensor-parallel over the
current process group), AdamW, the step and policy-version counters, and the Prometheus metrics.
It knows nothing of gRPC, buffers or weight transport:
- `logprobs(sequences)`: per-token log-probs under the current weights (`logprobs_routed`
  with an MoE model's recorded routing replayed: `replay.py`, which every forward here uses);
- `step(trajectories, staleness)`: one RL step (the advantages of `advantages.py`, the one place
  they are computed; the policy loss in the stage's mode, masked or ppo with IcePop, `loss.py`);
- `sft_step(trajectories)`: one supervised step (cross-entropy on loss-masked tokens);
- `new_version()`: declare the current weights a new policy version (on publish), resetting the
  optimizer moments if configured; `named_hf_tensors()`: the weights under HF names;
- `save_checkpoint()` / resume of the latest checkpoint on construction (`engine_checkpoints.py`).
With `config.lora`, a LoRA adapter on the frozen model is what trains and ships (`adapter.py`).

Every rank of the world (`tensor_parallel * data_parallel` processes, see `ranks.py`) makes
the same calls with the same whole batch: a data-parallel replica trains on its share of each
minibatch's rows, and gradients, the loss and the loss statistics are summed over the replicas
before clipping, so a step equals the one-replica step up to floating-point reduction order.
Micro-batches are padded or packed by a token budget (`microbatches.py`). A minibatch whose
loss or gradient norm is not finite is not applied (counted, `metrics.py`).
Checkpoints and exports are written by replica 0 alone; a resumed replica 0 hands its state to
the others at start-up.

`logp_train_old` (ppo mode's ratio and IcePop) is the log-prob under the weights at the start of
the step: the current one, computed anyway, with one update per step; with `minibatches_per_step
> 1` an extra no-grad pass. RL log-probs are at rollout's temperature (`RLTerms.temperature`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kiln.models import cpu_shims, dsa, moe, parallel
from kiln.models.hf_io import iter_hf_tensors, load_hf_checkpoint, save_hf_checkpoint
from kiln.metrics import STEP, StepMetrics
from kiln.models.megatron_model import forward_logits
from kiln.routing import RoutedExperts
from kiln.services.trainer import checkpoint as ckpt
from kiln.services.trainer import metrics, microbatches, rank_grads
from kiln.services.trainer.adapter import TrainerAdapter
from kiln.services.trainer.advantages import SequenceAdvantages, sequence_advantages, token_advantages
from kiln.services.trainer.batch import TensorBatch, collate, collate_tokens
from kiln.services.trainer.config import TrainerConfig
from kiln.services.trainer.engine_checkpoints import EngineCheckpoints
from kiln.services.trainer.loss import LossStats, loss_normalizer, policy_loss, sft_loss
from kiln.services.trainer.replay import score as score_routed
from kiln.trajectory import Trajectory

# (log-probs, micro-batch, trainer's log-probs before the step, normalizer, the student's log-probs of the teacher's top k or None) -> (loss, stats)
LossFn = Callable[[torch.Tensor, TensorBatch, torch.Tensor, float, torch.Tensor | None],
                  tuple[torch.Tensor, LossStats]]


class TrainerEngine(EngineCheckpoints):
    def __init__(self, config: TrainerConfig, *, resume: bool = True) -> None:
        self.config = config
        parallel.init_parallel(config.tensor_parallel, dp=config.data_parallel, ep=config.expert_parallel,
                               seed=config.seed,
                               timeout_s=config.collective_timeout_s)
        self.device = cpu_shims.compute_device()
        dtype = getattr(torch, config.params_dtype)
        self.model, self.spec = load_hf_checkpoint(config.model_dir, config.tensor_parallel, dtype, config.attention,
                                                   ep=config.expert_parallel)
        self._ep_ranks: list[dict] | None = None  # every EP rank's part of a resumed checkpoint
        self.adapter: TrainerAdapter | None = None
        if config.lora is not None:  # base weights frozen, adapters trained (kiln.models.lora)
            self._attach_lora(config.lora, "model_dir")
        else:
            self._new_optimizer()
        self.step_count = 0
        self.policy_version = 0
        self.published_step = 0
        """The step whose weights are `policy_version`'s (the initial weights: version 0)."""
        self.last_step: StepMetrics | None = None
        self.stage: str | None = None
        """Stage name for the metrics' `stage` label; None labels steps "sft" or "rl"."""
        self.stage_steps: dict[str, int] = {}
        """Optimizer steps taken per stage name; checkpointed, so a resumed stage continues."""
        self.resumed_from: Path | None = None
        self.last_checkpoint: Path | None = None
        """The newest checkpoint written or resumed from."""
        if resume and config.checkpoint_dir is not None:
            latest = ckpt.latest_checkpoint(config.checkpoint_dir)
            if latest is not None and parallel.dp_rank() == 0:
                self.load_checkpoint(latest)
        if parallel.dp_size() > 1:
            self._sync_replicas()
        metrics.TRAINER_VERSION.set(self.policy_version)

    def _new_optimizer(self) -> None:
        opt = self.config.optimizer
        # Frozen parameters (a DSA model's indexer, a LoRA model's base) stay out of the optimizer.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
        )
        warmup = opt.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    def _attach_lora(self, spec, base) -> None:
        """Freeze the weights as they are and put the adapter on; a fresh optimizer holds the
        adapter alone (the base's moments mean nothing to it). Collective at TP > 1."""
        self.adapter = TrainerAdapter(self.model, self.spec, spec, seed=self.config.seed, base=base,
                                      dtype=getattr(torch, self.config.params_dtype))
        # Trained weights were last published as the current version (a stage's end publishes).
        self.adapter.base_version = self.policy_version if base == "trained" else 0
        self._new_optimizer()

    def adapter_base(self):
        """(version, complete weights) of the frozen base a LoRA adapter applies to when earlier
        stages trained it, for a weight-sync that lost it; None without an adapter, on the
        job's own checkpoint (every replica starts from it), or at TP > 1 (the weights are
        gathered collectively, which only the publishing rank would join)."""
        if self.adapter is None or self.adapter.base != "trained" or self.config.tensor_parallel > 1:
            return None
        return self.adapter.base_version, iter_hf_tensors(self.model, self.spec)

    # --- log-probs -------------------------------------------------------------------------

    def _check_vocab(self, tokens: torch.Tensor) -> None:
        if tokens.numel() and (int(tokens.max()) >= self.spec.vocab_size or int(tokens.min()) < 0):
            raise ValueError(
                f"token ids must be in [0, {self.spec.vocab_size}); got {int(tokens.min())}..{int(tokens.max())}"
            )

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs of each sequence under the current weights (entry 0 is 0.0)."""
        return self.logprobs_routed(sequences, [None] * len(sequences), replay=False)[0]

    @torch.no_grad()
    def logprobs_routed(self, sequences: list[list[int]], routed: list[RoutedExperts | None], *,
                        replay: bool) -> tuple[list[list[float]], moe.RoutingFlips]:
        """`logprobs` with each sequence's MoE routing (or None) replayed or only compared, and the flips."""
        tokens, lengths = collate_tokens(sequences)
        self._check_vocab(tokens)
        self.model.eval()
        return score_routed(self.model, tokens.to(self.device), lengths, routed,
                            self.config.micro_batch_size, "replay" if replay else "record")

    @torch.no_grad()
    def index_hashes(self, sequences: list[list[int]]) -> list[list[int]]:
        """DSA models: per sequence, one hash per attention layer of the top-k indices selected
        for its tokens but the last (as `Generation.index_hashes`); empty lists for a dense model.
        Compare with `dsa.count_mismatches`."""
        tokens, lengths = collate_tokens(sequences)
        self._check_vocab(tokens)
        self.model.eval()
        out: list[list[int]] = []
        mbs = self.config.micro_batch_size
        for i in range(0, len(sequences), mbs):
            n = max(lengths[i : i + mbs])
            with dsa.record_indices(self.model) as indices:
                forward_logits(self.model, tokens[i : i + mbs, :n].to(self.device))
            out.extend(dsa.sequence_hashes(indices, r, length) if indices else []
                       for r, length in enumerate(lengths[i : i + mbs]))
        return out

    # --- training steps --------------------------------------------------------------------

    def step(self, batch: list[Trajectory], staleness: list[int] | None = None) -> StepMetrics:
        """One RL step on `batch` (policy loss). Returns the step's metrics. `staleness` (from
        the buffer, per trajectory) is counted into the metrics as `staleness_<k>`."""
        cfg, terms = self.config.loss, self.config.terms
        # Advantages (advantages.py): per sequence here, over whole groups; per token in loss_fn.
        per_seq = sequence_advantages(batch, terms.advantage_norm)
        distill = not terms.kl_coef and any(t.teacher_logp for t in batch)

        def loss_fn(logp, mb, train_old, normalizer, student_topk):
            # A KL-penalised stage's frozen log-probs are the reference's: nothing is distilled.
            # Distillation takes the student's log-probs at the start of the step (`train_old`),
            # as a reward is fixed before it: a later minibatch must not move its own advantage.
            adv = token_advantages(mb, train_old, distill=distill, sampled_weight=terms.sampled_weight,
                                   task_reward_weight=terms.task_reward_weight)
            frozen = (dict(kl_coef=terms.kl_coef, kl_clamp=terms.kl_clamp, logp_ref=mb.teacher_logp,
                           has_ref=mb.has_teacher)
                      if terms.kl_coef else
                      dict(dense_weight=terms.dense_weight, student_topk=student_topk,
                           teacher_topk=mb.topk_logp, has_topk=mb.has_topk))
            return policy_loss(logp, mb.logp_infer, mb.loss_mask, adv, cfg, logp_train_old=train_old,
                               normalizer=normalizer, correction=terms.correction, **frozen)

        return self._run(batch, loss_fn, needs_old=cfg.mode == "ppo" or distill, aggregation=cfg.aggregation,
                         rl=True, staleness=staleness, advantages=per_seq)

    def sft_step(self, batch: list[Trajectory]) -> StepMetrics:
        """One supervised step: cross-entropy on the loss-masked tokens of `batch`."""
        agg = self.config.loss.aggregation

        def loss_fn(logp, mb, train_old, normalizer, student_topk):
            return sft_loss(logp, mb.loss_mask, aggregation=agg, normalizer=normalizer)

        return self._run(batch, loss_fn, needs_old=False, aggregation=agg, rl=False)

    def _run(
        self, batch: list[Trajectory], loss_fn: LossFn, *, needs_old: bool, aggregation: str, rl: bool,
        staleness: list[int] | None = None, advantages: SequenceAdvantages | None = None,
    ) -> StepMetrics:
        t0 = time.perf_counter()
        if self.config.lora is not None and self.adapter is None:  # a LoRA stage after full-weight ones
            self._attach_lora(self.config.lora, "trained")
        tb = collate(batch, *advantages) if advantages is not None else collate(batch)
        self._check_vocab(tb.tokens)
        if tb.loss_mask.sum() == 0:
            raise ValueError("batch has no trainable tokens (every loss_mask is 0)")
        replay = rl and self.config.routing_replay == "replay"
        straddled = microbatches.mask_straddled_routing(batch, tb) if replay else None
        tb = tb.to(self.device)
        parts = [p for p in torch.tensor_split(torch.arange(len(batch)), self.config.minibatches_per_step) if len(p)]
        budget = self.config.max_tokens_per_micro_batch  # packing (microbatches.py), or None
        old = None  # the start of the step's log-probs, in eval mode (train mode below)
        if needs_old and len(parts) > 1:
            old = microbatches.start_of_step_logprobs(self.model, tb, self.config.micro_batch_size, budget,
                                                      self.config.routing_replay, self.config.terms.temperature)

        self.model.train()
        stats = LossStats()
        losses, norms = [], []
        dp, dp_rank = parallel.dp_size(), parallel.dp_rank()
        # The learning rate of this step (a stage sets it per step): every minibatch of the step
        # takes it, and it is the one reported.
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        dense = self.config.terms.dense_weight > 0  # the student's log-probs of a teacher's top k
        temp = self.config.terms.temperature if rl else 1.0  # rollout's sampling temperature
        for part in parts:
            mask = tb.loss_mask[part]
            normalizer = loss_normalizer(mask, aggregation, self.config.terms.seq_sum_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            part_loss = 0.0
            part_stats = LossStats()
            # This replica's rows of the minibatch; the normalizer above is the whole
            # minibatch's, so the replicas' summed gradients are the one-replica gradient.
            rows = microbatches.replica_rows(part, tb.lengths, dp, dp_rank, budget)
            passes = microbatches.split(rows, tb.lengths, self.config.micro_batch_size, budget)
            rank_grads.idle_expert_passes(self.model, len(passes))
            for idx in passes:
                mb = tb.select(idx)
                logp, flips, student_topk = microbatches.logprobs(self.model, mb, self.config.routing_replay, budget,
                                                                  topk=rl and dense, temperature=temp)
                train_old = old[idx][:, : logp.shape[1]] if old is not None else logp.detach()
                loss, st = loss_fn(logp, mb, train_old, normalizer, student_topk)
                st.routing_flips, st.routing_compared = flips.flips, flips.compared
                loss.backward()
                part_loss += loss.item()
                part_stats = part_stats.merge(st)
            rank_grads.sum_head_norm_grads(self.model)
            if dp > 1:
                # This minibatch's alone: the ones before were summed over replicas already.
                part_loss, part_stats = self._reduce_replicas(part_loss, part_stats)
            stats = stats.merge(part_stats)
            norms.append(self._clip_grads())
            if math.isfinite(part_loss) and math.isfinite(norms[-1]):
                self.optimizer.step()
            else:  # a poisoned minibatch: its update is dropped, never applied, and counted
                self.optimizer.zero_grad(set_to_none=True)
                metrics.count_nonfinite(self.stage or ("rl" if rl else "sft"), part_loss, norms[-1])
            losses.append(part_loss)
        self.scheduler.step()
        self.step_count += 1

        elapsed = time.perf_counter() - t0
        loss_stats = stats.as_dict()
        tokens = int(loss_stats.pop("tokens"))
        out = StepMetrics(
            step=self.step_count, policy_version=self.policy_version,
            loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms), lr=lrs[0],
            sequences=len(batch), tokens=tokens, step_seconds=elapsed,
            tokens_per_second=tb.num_tokens / elapsed if elapsed > 0 else 0.0,
            # The masks, drift and reward mean nothing in a supervised step (kiln.metrics).
            **{k: v for k, v in loss_stats.items() if rl or not STEP[k].rl_only},
            **({"reward_mean": sum(t.reward for t in batch) / len(batch)} if rl else {}),
            **({"routing_straddle_frac": straddled} if straddled is not None else {}))
        if staleness is not None:
            # How many versions behind the trainer each trajectory's oldest token was when the
            # buffer served it (the buffer computes it, where freshness is enforced), counted
            # per value: the run report's staleness histogram.
            for k in staleness:
                out.staleness[k] = out.staleness.get(k, 0) + 1
        self.last_step = out
        if self.stage:
            self.stage_steps[self.stage] = self.stage_steps.get(self.stage, 0) + 1
        metrics.observe_step(out, self.stage or ("rl" if rl else "sft"))
        self.maybe_checkpoint()
        return out

    def _reduce_replicas(self, loss: float, stats: LossStats) -> tuple[float, LossStats]:
        """Sum gradients, the loss and the loss statistics over the DP replicas."""
        grads = []
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:  # a replica with no rows in this minibatch
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        names = [f.name for f in dataclasses.fields(stats)]
        scalars = torch.tensor([loss] + [getattr(stats, n) for n in names], dtype=torch.float64)
        rank_grads.sum_over_replicas(self.model, grads)
        parallel.all_reduce_dp([scalars])
        values = scalars.tolist()
        return values[0], LossStats(**dict(zip(names, values[1:])))

    def _clip_grads(self) -> float:
        """Global gradient norm over all TP shards; clip in place if configured. Megatron's own
        clip function assumes CUDA tensors, hence this one."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = rank_grads.global_norm(params, self.device)
        clip = self.config.optimizer.grad_clip
        if clip > 0 and clip < norm < math.inf:  # a non-finite norm is never applied (`_run`)
            scale = clip / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        return norm

    # --- versions and weights --------------------------------------------------------------

    def new_version(self) -> int:
        """Declare the current weights policy version `version + 1` (call when publishing
        them); resets the optimizer moments if configured. Returns the new version."""
        self.policy_version += 1
        self.published_step = self.step_count
        if self.config.optimizer.reset_moments_on_publish:
            self.reset_optimizer_moments()
        metrics.TRAINER_VERSION.set(self.policy_version)
        return self.policy_version

    @property
    def unpublished(self) -> bool:
        """Whether the weights changed since their version was published (a checkpoint taken
        between publishes resumes so: an SFT stage publishes only at its end)."""
        return self.step_count != self.published_step

    def reset_optimizer_moments(self) -> None:
        """Zero AdamW's first and second moments and its step count (so bias correction starts
        afresh, as for a new optimizer)."""
        for state in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    state[key].zero_()
            if "step" in state:
                state["step"].zero_()

    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a policy version carries, under Hugging Face names (collective at TP > 1): the
        full weights, or with LoRA only the adapter's A and B under PEFT's names, which rollout
        merges into its pristine base weights (`kiln.models.lora.merge_adapter`)."""
        if self.adapter is not None:
            return self.adapter.version_tensors()
        return iter_hf_tensors(self.model, self.spec)

    def gathered_hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights under HF names, gathered over TP on replica 0 (collective there);
        an empty list on the other replicas, which hold the same weights."""
        if parallel.dp_rank() == 0 or rank_grads.sends_experts_to_replica_0():
            tensors = list(self.named_hf_tensors())  # collective over TP (and EP) there
            return tensors if parallel.dp_rank() == 0 else []
        return []

    def export_hf(self, out_dir: Path) -> Path | None:
        """Write the current weights as a HF checkpoint directory (replica 0's TP rank 0
        writes; the others return None)."""
        if parallel.dp_rank() != 0:
            if rank_grads.sends_experts_to_replica_0():
                for _ in iter_hf_tensors(self.model, self.spec):
                    pass
            return None
        if self.adapter is not None:  # a whole model for later stages and engines: merged
            return self.adapter.write_merged(out_dir, self.config.model_dir)
        return save_hf_checkpoint(self.model, self.spec, out_dir, source_dir=self.config.model_dir)
