"""`kiln export RUN_DIR [--step N] --out DIR`: a run's trained policy as a Hugging Face checkpoint.

The trainer's checkpoint of step N (default: the newest) is loaded into the trainer's own model
code and written as a Hugging Face directory: model.safetensors, config.json,
generation_config.json and the tokenizer with its chat template, which `transformers` and vLLM
load directly. `kiln run` leaves the same for the last stage in `RUN_DIR/final-hf/`, and every
finished stage's weights in `RUN_DIR/trainer/stages/<stage>/`.

RUN_DIR may also be a cluster job's output (`spec.output`, `kiln.api.outputs`), a folder or an
`s3://bucket/prefix` location (credentials and `AWS_ENDPOINT_URL_S3` from the environment): it
holds each finished stage's Hugging Face checkpoint already, and the newest (or `--stage
NAME`'s) is copied to --out; it keeps no trainer checkpoints, so `--step` does not apply there.

A LoRA job's checkpoint (`spec.model.lora`) is written as a PEFT adapter (adapter_config.json,
adapter_model.safetensors, and the tokenizer), which `peft.PeftModel.from_pretrained` puts on
the base model; `--merge` writes the merged model as a Hugging Face checkpoint instead (what
`RUN_DIR/final-hf/` and the stages' folders hold for such a job).

A checkpoint of `trainer.expertParallel` > 1 (each EP rank's experts in its part) is merged:
every expert under its global index.

Not covered: checkpoints of tensorParallel > 1 (each rank holds a shard; the trainer's own
stage exports gather them).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a run's trained policy as a Hugging Face checkpoint",
        description="Write the policy of a run's trainer checkpoint (the newest, or --step N) as a "
                    "Hugging Face checkpoint directory (safetensors, config, generation config, "
                    "tokenizer and chat template) that transformers and vLLM load.")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="run directory of `kiln run`, or a cluster job's output (a folder or "
                        "s3://bucket/prefix)")
    p.add_argument("--out", type=Path, required=True,
                   help="directory to write: new or empty (a non-empty one needs --force)")
    p.add_argument("--force", action="store_true",
                   help="replace --out even when it holds files")
    p.add_argument("--step", type=int, default=None,
                   help="optimizer step of the checkpoint to export (default: the newest)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA jobs: write the base with the adapter merged in, a whole Hugging Face "
                        "checkpoint, instead of the PEFT adapter")
    p.add_argument("--stage", default=None,
                   help="from a cluster job's output folder: the stage whose model to copy "
                        "(default: the newest finished)")
    p.set_defaults(func=run)


def checkpoint_for(run_dir: Path, step: int | None) -> Path:
    """The checkpoint directory of `step` (None: the newest); ValueError saying what exists."""
    from kiln.services.trainer.checkpoint import list_checkpoints, step_dir_name

    root = run_dir / "trainer" / "checkpoints"
    found = list_checkpoints(root)
    if not found:
        raise ValueError(f"{root} holds no checkpoint (did the run take a step?)")
    if step is None:
        return found[-1]
    for path in found:
        if path.name == step_dir_name(step):
            return path
    steps = ", ".join(p.name.removeprefix("step_").lstrip("0") or "0" for p in found)
    raise ValueError(f"--step {step}: no checkpoint of that step under {root} (steps: {steps})")


def check_out(out: Path, force: bool) -> None:
    """ValueError unless `out` may be written: absent, an empty folder, or `force`."""
    if force or not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir() or out.is_symlink():
        raise ValueError(f"--out {out}: exists and is not a folder")
    if any(out.iterdir()):
        raise ValueError(f"--out {out}: the folder is not empty (its files would be replaced); "
                         "give --force to replace it, or another folder")


def export_run(run_dir: Path, out: Path, step: int | None = None, *, force: bool = False,
               merge: bool = False) -> Path:
    """Export checkpoint `step` of the run in `run_dir` to `out`; returns `out`. ValueError
    when `out` holds files and `force` is not given. A LoRA checkpoint gives a PEFT adapter,
    or with `merge` the merged model."""
    check_out(out, force)
    import torch

    from kiln.api.validate import load_job
    from kiln.services.trainer.config import TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine

    job_file = run_dir / "job.yaml"
    if not job_file.exists():
        raise ValueError(f"{run_dir} holds no job.yaml; not a run directory of `kiln run`")
    job = load_job(job_file)
    ckpt = checkpoint_for(run_dir, step)
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta.get("tensor_parallel", 1) != 1:
        raise ValueError(f"{ckpt} was written by {meta['tensor_parallel']} tensor-parallel ranks; "
                         "export it from its stage's weights in RUN_DIR/trainer/stages/ instead")
    dtype = job.spec.model.dtype if job.spec.model.dtype != "float16" else "float32"
    engine = TrainerEngine(TrainerConfig(model_dir=job.spec.model.local_path(), params_dtype=dtype,
                                         checkpoint_dir=ckpt.parent, seed=job.spec.seed),
                           resume=False)
    # A LoRA checkpoint puts its adapter on (its meta says which); one whose experts were split
    # over EP ranks is merged into the whole model.
    engine.load_weights(ckpt)
    with torch.no_grad():
        if engine.adapter is not None and not merge:  # PEFT's adapter files
            return engine.adapter.write_peft(out, engine.config.model_dir, _adapter_base(run_dir, job))
        return engine.export_hf(out)


def _adapter_base(run_dir: Path, job) -> str:
    """The model a LoRA job's adapter goes on: `spec.model.path`, or the weights of the last
    stage that trained every weight (`lora.stages`), in RUN_DIR/trainer/stages/."""
    from kiln.services.trainer.stages import stage_export_dir

    full = [s.name for s in job.spec.stages if not job.spec.model.lora.trains(s.name)]
    if not full:
        return str(job.spec.model.local_path().absolute())
    return str(stage_export_dir(run_dir / "trainer", full[-1]))


def is_output_dir(path: Path) -> bool:
    """Whether `path` is a cluster job's output folder rather than a run directory."""
    return (path / "summary.json").exists() and (path / "stages").is_dir() \
        and not (path / "trainer").exists()


def export_output(output: Path | str, out: Path, stage: str | None, *,
                  force: bool = False) -> Path:
    """Copy a stage's model (default the newest finished: `final-hf/`) from a job's output
    (a folder or an s3:// location) to `out`; ValueError saying what is there."""
    check_out(out, force)
    if "://" in str(output):
        return _download_output(str(output).rstrip("/"), out, stage)
    src = output / "final-hf" if stage is None else output / "stages" / stage
    if not (src / "config.json").exists():
        have = sorted(p.name for p in (output / "stages").iterdir() if (p / "config.json").exists())
        raise ValueError(f"{src} holds no Hugging Face checkpoint (finished stages there: "
                         f"{', '.join(have) or 'none yet'})")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def _download_output(uri: str, out: Path, stage: str | None) -> Path:
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    src = f"{root}/final-hf" if stage is None else f"{root}/stages/{stage}"
    if not fs.exists(f"{src}/config.json"):
        have = sorted(p.rsplit("/", 1)[-1] for p in (fs.ls(f"{root}/stages", detail=False)
                                                     if fs.exists(f"{root}/stages") else []))
        raise ValueError(f"{uri}: no Hugging Face checkpoint at {src} (finished stages there: "
                         f"{', '.join(have) or 'none yet'})")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for key in fs.find(src):
        target = tmp / key.removeprefix(f"{src}/")
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(key, str(target))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def final_hf(run_dir: Path, job) -> Path | None:
    """`RUN_DIR/final-hf/`: the last stage's exported weights (hard links where possible)."""
    from kiln.services.trainer.stages import stage_export_dir

    src = stage_export_dir(run_dir / "trainer", job.spec.stages[-1].name)
    if not (src / "config.json").exists():
        return None
    dst = run_dir / "final-hf"
    tmp = run_dir / ".final-hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst


def _link_or_copy(src: str, dst: str) -> None:
    import os

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def run(args: argparse.Namespace) -> int:
    remote = "://" in str(args.run_dir)
    args.run_dir = str(args.run_dir) if remote else Path(args.run_dir)
    try:
        if remote or is_output_dir(args.run_dir):
            if args.step is not None:
                raise ValueError(f"--step: {args.run_dir} is a job's output folder, which keeps "
                                 "each stage's final model, not the trainer's steps; use --stage")
            out = export_output(args.run_dir if remote else args.run_dir.resolve(),
                                args.out.absolute(), args.stage, force=args.force)
        elif args.stage is not None:
            raise ValueError(f"--stage: {args.run_dir} is a run directory; its stages' models are "
                             "in RUN_DIR/trainer/stages/ (export a step with --step)")
        else:
            out = export_run(args.run_dir.resolve(), args.out.absolute(), args.step,
                             force=args.force, merge=args.merge)
    except ValueError as exc:
        print(f"kiln export: {exc}", file=sys.stderr)
        return Exit.REFUSED
    print(out)
    return 0
