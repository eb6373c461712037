"""`kiln run` as a user runs it: the cut-down quickstart job the end-to-end tests share, the
command itself, and the run's metrics records."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
import yaml


REPO = Path(__file__).resolve().parents[2]


TAU = 1


def cut_down_job(tmp: Path) -> Path:
    job = yaml.safe_load((REPO / "deploy" / "examples" / "quickstart.yaml").read_text())
    spec = job["spec"]
    job["metadata"]["name"] = "e2e"
    spec["model"]["path"] = str(tmp / "model")
    spec["model"]["init"].update(hiddenSize=64, numLayers=1, numHeads=2, numKvHeads=1,
                                 intermediateSize=128)
    spec["tasks"][0]["generate"]["count"] = 300
    spec["tasks"][1]["generate"]["count"] = 8
    sft, rl = spec["stages"]
    sft.update(maxSteps=8, batchSize=16, microBatchSize=16, warmupSteps=0)
    rl.update(maxSteps=6, batchSize=16, microBatchSize=16)
    rl["rl"].update(groupSize=4, tau=TAU)
    spec["rollout"].update(maxConcurrentEpisodes=32)
    spec["sandbox"]["maxConcurrent"] = 32
    # Two data-parallel trainer replicas: the launcher starts, waits for and stops both.
    spec.setdefault("trainer", {})["dataParallel"] = 2
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def kiln_run(job: Path, run: Path, timeout: float = 900) -> str:
    """`kiln run JOB --run-dir RUN` to its end; its output. Fails the test on a non-zero exit."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(job), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=job.parent)
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            # Ctrl-C: the launcher stops every service it started before it exits.
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    assert proc.returncode == 0, out[-4000:]
    return out


def read_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
