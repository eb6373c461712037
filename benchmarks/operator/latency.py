"""The operator's latencies: `kubectl apply` to the first trained step, and reconcile latency
for many RLJobs in one namespace.

1. first step: on a development cluster (`kiln dev-cluster`), the time from `kubectl apply` of a
   cut-down quickstart job to the job's status showing a trained step; baseline in the same
   run: `kiln run` of the same job to its first trained step (metrics.jsonl).
2. reconcile: the real operator process against the fake API server (no node agent: nothing
   runs, only the control plane is measured); N RLJobs are created at once and each one's
   latency is the time from its creation to `status.phase: Pending` (all 13 children applied).
   Baseline in the same run: one job alone. Also the operator's CPU seconds and peak RSS, and
   how long it takes to stop on SIGTERM with every job's driver running.

    python benchmarks/operator/latency.py [--jobs 50] [--skip-first-step]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kiln.cli.devcluster.api import running_fake_api, write_kubeconfig

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KUBECTL = REPO / ".tools" / "bin" / "kubectl"


def small_job(name: str, model: str) -> dict:
    job = yaml.safe_load((REPO / "deploy" / "examples" / "quickstart.yaml").read_text())
    spec = job["spec"]
    job["metadata"]["name"] = name
    spec["model"]["path"] = model
    spec["model"]["init"].update(hiddenSize=64, numLayers=1, numHeads=2, numKvHeads=1,
                                 intermediateSize=128)
    spec["tasks"][0]["generate"]["count"] = 300
    spec["tasks"][1]["generate"]["count"] = 8
    sft, rl = spec["stages"]
    sft.update(maxSteps=20, batchSize=16, microBatchSize=16, warmupSteps=0)
    rl.update(maxSteps=2, batchSize=16, microBatchSize=16)
    rl["rl"].update(groupSize=4)
    return job


def first_step_cluster(tmp: Path) -> float:
    cluster = tmp / "cluster"
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump(small_job("bench", "model-cluster")))
    subprocess.run([str(BIN / "kiln"), "dev-cluster", "up", str(cluster)], cwd=tmp, check=True)
    try:
        kc = ["--kubeconfig", str(cluster / "kubeconfig")]
        t0 = time.monotonic()
        subprocess.run([str(KUBECTL), *kc, "apply", "--validate=false", "-f", str(job)],
                       check=True, capture_output=True)
        while time.monotonic() - t0 < 900:
            out = subprocess.run([str(KUBECTL), *kc, "get", "rljob", "bench", "-o", "json"],
                                 capture_output=True, text=True)
            status = json.loads(out.stdout).get("status") or {} if out.returncode == 0 else {}
            if status.get("stage") == "sft" and status.get("step", 0) >= 1:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError("no trained step within 900 s")
    finally:
        subprocess.run([str(BIN / "kiln"), "dev-cluster", "down", str(cluster)])


def first_step_local(tmp: Path) -> float:
    job = tmp / "local.yaml"
    job.write_text(yaml.safe_dump(small_job("bench-local", str(tmp / "model-local"))))
    run = tmp / "run"
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "kiln"), "run", str(job), "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < 900:
            metrics = run / "metrics.jsonl"
            if metrics.exists():
                for line in metrics.read_text().splitlines():
                    rec = json.loads(line)
                    if rec.get("event") == "progress" and rec.get("step", 0) >= 1:
                        return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError("no trained step within 900 s")
    finally:
        proc.terminate()
        proc.wait(120)


def _proc_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    peak = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM"))
    return cpu, peak / 1024


def reconcile(tmp: Path, jobs: int) -> dict:
    import kubernetes

    results: dict = {}
    with running_fake_api() as (fake, url):
        fake.add_namespace("bench")
        kubeconfig = write_kubeconfig(tmp / "kubeconfig", url, "bench")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KILN_OPERATOR_STATUS_INTERVAL": "15",
               "KILN_OPERATOR_GRPC_TIMEOUT": "0.5",
               # No pods run: every service address refuses connections at once, as a cluster
               # Service without ready endpoints does (a name that does not resolve would
               # instead measure this machine's DNS timeouts).
               "KILN_OPERATOR_ADDRESS_TEMPLATE": "127.0.0.1:9"}
        op = subprocess.Popen([str(BIN / "kiln-operator"), "--namespace", "bench", "--liveness",
                               "", "--metrics-port", "0"], env=env,
                              stdout=open(tmp / "operator.log", "wb"), stderr=subprocess.STDOUT)
        api = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kubeconfig)))
        try:
            time.sleep(3)
            cpu0, _ = _proc_usage(op.pid)

            def batch(names: list[str]) -> list[float]:
                created = {}
                for n in names:
                    api.create_namespaced_custom_object("kiln.dev", "v1alpha1", "bench", "rljobs",
                                                        small_job(n, "m"))
                    created[n] = time.monotonic()
                done: dict[str, float] = {}
                while len(done) < len(names) and time.monotonic() - min(created.values()) < 600:
                    # One list per poll (asking for each job would load the API server itself).
                    items = api.list_namespaced_custom_object("kiln.dev", "v1alpha1", "bench",
                                                              "rljobs")["items"]
                    now = time.monotonic()
                    for obj in items:
                        n = obj["metadata"]["name"]
                        if n in created and n not in done and \
                                (obj.get("status") or {}).get("phase") == "Pending":
                            done[n] = now - created[n]
                    time.sleep(0.1)
                return [done[n] for n in names if n in done]

            alone = batch(["solo"])
            many = batch([f"job-{i:02d}" for i in range(jobs)])
            time.sleep(30)  # two status intervals of 50 idle jobs
            cpu1, peak = _proc_usage(op.pid)
            s = sorted(many)
            results = {"alone_s": round(alone[0], 3), "jobs": jobs, "reconciled": len(many),
                       "p50_s": round(s[len(s) // 2], 3), "p99_s": round(s[int(0.99 * (len(s) - 1))], 3),
                       "mean_s": round(statistics.fmean(s), 3),
                       "operator_cpu_s": round(cpu1 - cpu0, 1), "operator_peak_rss_mib": round(peak)}
            print(json.dumps(results), flush=True)
        finally:
            t_stop = time.monotonic()
            op.terminate()
            try:
                op.wait(60)
                print(json.dumps({"operator_stop_s": round(time.monotonic() - t_stop, 1)}), flush=True)
            except subprocess.TimeoutExpired:
                print("the operator did not stop within 60 s of SIGTERM; killed", flush=True)
                op.kill()
                op.wait()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--skip-first-step", action="store_true")
    p.add_argument("--skip-reconcile", action="store_true")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if not args.skip_first_step:
        local = first_step_local(tmp)
        cluster = first_step_cluster(tmp)
        print(json.dumps({"first_step_kiln_run_s": round(local, 1),
                          "first_step_dev_cluster_s": round(cluster, 1)}), flush=True)
    if not args.skip_reconcile:
        reconcile(tmp, args.jobs)


if __name__ == "__main__":
    main()
