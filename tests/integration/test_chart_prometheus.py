"""The chart's alerts and dashboard, checked by promtool and a real Prometheus.

- the PrometheusRule rendered by helm passes `promtool check rules`, and `promtool test rules`
  shows each drift alert firing for the job that drifts and not for the healthy one;
- every dashboard query, with its variables substituted, is valid PromQL (checked as recording
  rules by promtool) and returns data from a Prometheus scraping a process that exports Kiln's
  metrics (kiln.services.common.metrics) on 127.0.0.1.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kiln"
TOOLS = ROOT / ".tools" / "bin"
HELM, PROMTOOL, PROMETHEUS = TOOLS / "helm", TOOLS / "promtool", TOOLS / "prometheus"
DASHBOARD = CHART / "files" / "kiln-off-policy-drift.json"

pytestmark = pytest.mark.skipif(
    not all(p.exists() for p in (HELM, PROMTOOL, PROMETHEUS)),
    reason=f"helm, promtool and prometheus are installed in {TOOLS} by deploy/setup.sh")


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = run(HELM, "template", "kiln", CHART, "--namespace", "kiln-system",
              "--set", "prometheusRule.enabled=true", "--show-only", "templates/prometheusrule.yaml")
    rule = yaml.safe_load(out)
    path = tmp_path_factory.mktemp("rules") / "kiln-alerts.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def test_alert_rules_pass_promtool_check(rules_file: Path) -> None:
    out = run(PROMTOOL, "check", "rules", rules_file)
    assert "SUCCESS: 13 rules found" in out


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _buckets(name: str, labels: dict[str, str], bounds: list[str], hot: str,
             per_minute: int = 10) -> list[dict[str, str]]:
    """Cumulative histogram buckets whose observations all fall in the bucket `hot`."""
    out = []
    hit = False
    for le in bounds:
        hit = hit or le == hot
        values = f"0+{per_minute}x40" if hit else "0x40"
        out.append(_series(f"{name}_bucket", {**labels, "le": le}, values))
    return out


BAD = {"namespace": "team-a", "rljob": "drifting"}
GOOD = {"namespace": "team-a", "rljob": "healthy"}
# As stale as BAD, but its stage allows twice the lag: the staleness alert is relative to tau.
LOOSE = {"namespace": "team-a", "rljob": "loose-tau"}
# Strictly on-policy (tau 0): everything served is fresh, nothing is "close" to the bound.
ON_POLICY = {"namespace": "team-a", "rljob": "on-policy"}
# A supervised stage: no tau series at all.
SFT = {"namespace": "team-a", "rljob": "sft"}
# As stale as BAD throughout; its second stage (from minute 18) has tau 4 where the first had 8.
RETUNED = {"namespace": "team-a", "rljob": "retuned"}
RUNBOOKS = "https://kiln.dev/docs/guides/troubleshooting/"
STALENESS_LE = ["0", "1", "2", "3", "4", "6", "8", "12", "16", "32", "+Inf"]
SYNC_LE = ["0.01", "0.05", "0.1", "0.25", "0.5", "1", "2", "5", "10", "30", "60", "+Inf"]


def _alert(name: str, at: str, labels: dict[str, str], severity: str = "warning") -> dict[str, Any]:
    return {"eval_time": at, "alertname": name,
            "exp_alerts": [{"exp_labels": {"severity": severity, **labels}}]}


def test_alert_rules_fire_for_the_drifting_job_only(rules_file: Path) -> None:
    series = [
        *_buckets("kiln_trajectory_staleness", BAD, STALENESS_LE, "4"),
        *_buckets("kiln_trajectory_staleness", GOOD, STALENESS_LE, "1"),
        *_buckets("kiln_trajectory_staleness", LOOSE, STALENESS_LE, "4"),
        *_buckets("kiln_trajectory_staleness", ON_POLICY, STALENESS_LE, "0"),
        *_buckets("kiln_trajectory_staleness", SFT, STALENESS_LE, "4"),
        # p90 staleness is 3.9 for BAD and LOOSE: at or above 0.75 * 4, below 0.75 * 8.
        _series("kiln_freshness_tau", {**BAD, "stage": "rl"}, "4x40"),
        _series("kiln_freshness_tau", {**GOOD, "stage": "rl"}, "4x40"),
        _series("kiln_freshness_tau", {**LOOSE, "stage": "rl"}, "8x40"),
        _series("kiln_freshness_tau", {**ON_POLICY, "stage": "rl"}, "0x40"),
        *_buckets("kiln_trajectory_staleness", RETUNED, STALENESS_LE, "4"),
        _series("kiln_freshness_tau", {**RETUNED, "stage": "explore"}, "8x17 stale"),
        _series("kiln_freshness_tau", {**RETUNED, "stage": "exploit"}, "_x18 4x22"),
        _series("kiln_trajectories_dropped_stale_total", BAD, "0+5x40"),
        _series("kiln_trajectories_accepted_total", BAD, "0+20x40"),
        _series("kiln_trajectories_dropped_stale_total", GOOD, "0x40"),
        _series("kiln_trajectories_accepted_total", GOOD, "0+20x40"),
        _series("kiln_ratio_mask_fraction", BAD, "0.35x40"),
        _series("kiln_ratio_mask_fraction", GOOD, "0.02x40"),
        _series("kiln_icepop_mask_fraction", BAD, "0.3x40"),
        _series("kiln_icepop_mask_fraction", GOOD, "0.01x40"),
        _series("kiln_logprob_mismatch_kl", BAD, "0.2x40"),
        _series("kiln_logprob_mismatch_kl", GOOD, "0.001x40"),
        _series("kiln_logprob_mismatch_abs_mean", GOOD, "0.01x40"),
        *_buckets("kiln_weight_sync_seconds", BAD, SYNC_LE, "60"),
        *_buckets("kiln_weight_sync_seconds", GOOD, SYNC_LE, "0.5"),
        _series("kiln_weight_sync_failures_total", {**BAD, "reason": "checksum"}, "0+1x40"),
        _series("kiln_train_step", {**BAD, "stage": "rl"}, "12x40"),
        _series("kiln_train_step", {**GOOD, "stage": "rl"}, "0+1x40"),
        _series("kiln_service_up", {**BAD, "service": "trainer"}, "1x40"),
        _series("kiln_service_up", {**GOOD, "service": "trainer"}, "1x40"),
        _series("kiln_sandbox_failures_total", {**BAD, "backend": "docker", "reason": "oom"}, "0+3x40"),
        _series("kiln_sandbox_start_seconds_count", {**BAD, "backend": "docker"}, "0+10x40"),
        _series("kiln_sandbox_failures_total", {**GOOD, "backend": "docker", "reason": "oom"}, "0x40"),
        _series("kiln_sandbox_start_seconds_count", {**GOOD, "backend": "docker"}, "0+10x40"),
        _series("kiln_buffer_write_errors_total", {**BAD, "errno": "ENOSPC"}, "0+4x40"),
        _series("kiln_buffer_write_errors_total", {**GOOD, "errno": "ENOSPC"}, "0x40"),
        _series("kiln_rpc_requests_total", {**BAD, "method": "/kiln.v1.WeightSync/Publish",
                                            "code": "PERMISSION_DENIED"}, "0+2x40"),
        _series("kiln_rpc_requests_total", {**GOOD, "method": "/kiln.v1.WeightSync/Publish",
                                            "code": "OK"}, "0+2x40"),
        _series("kiln_trainer_nonfinite_steps_total", {**BAD, "stage": "rl", "reason": "loss"},
                "0x10 1x30"),
        _series("kiln_trainer_nonfinite_steps_total", {**GOOD, "stage": "rl", "reason": "loss"}, "0x40"),
        # Prometheus' test clock starts at the Unix epoch: one certificate expires on day 2,
        # the other in three years.
        _series("kiln_certificate_expiry_timestamp_seconds", {**BAD, "component": "buffer"},
                "172800x120"),
        _series("kiln_certificate_expiry_timestamp_seconds", {**GOOD, "component": "buffer"},
                "94608000x120"),
    ]
    alerts = ["KilnStalenessNearTau", "KilnTrajectoriesDroppedStale", "KilnRatioMaskFractionHigh",
              "KilnIcePopMaskFractionHigh", "KilnTrainInferenceMismatchHigh", "KilnWeightSyncSlow",
              "KilnWeightSyncFailing", "KilnSandboxFailuresHigh"]
    cases = [_alert(a, "25m", BAD) for a in alerts]
    # Annotations are checked in full for two alerts (templating with labels and values); the
    # others are checked for when and for whom they fire.
    cases[2]["exp_alerts"][0]["exp_annotations"] = {
        "summary": "The ratio mask drops many tokens in RLJob team-a/drifting",
        "description": "35% of trained tokens fall outside [1 - epsLow, 1 + epsHigh]; the policy "
                       "moves far from the one that generated the data.",
        "runbook_url": RUNBOOKS + "#kilnratiomaskfractionhigh"}
    # Not yet: conditions must hold for `for` (10m) first.
    cases += [{"eval_time": "5m", "alertname": a, "exp_alerts": []} for a in alerts]
    cases.append(_alert("KilnTrainingStalled", "30m", BAD, severity="critical"))
    cases[-1]["exp_alerts"][0]["exp_annotations"] = {
        "summary": "RLJob team-a/drifting has stopped training",
        "description": "The trainer is up but took no optimizer step in 15 minutes; check the "
                       "buffer depth and the rollout and sandbox services.",
        "runbook_url": RUNBOOKS + "#kilntrainingstalled"}
    cases.append({"eval_time": "10m", "alertname": "KilnTrainingStalled", "exp_alerts": []})
    # The retuned job's alert follows its new stage's tau: pending from minute 18 (so not at
    # 25 above), firing 10 minutes later.
    cases.append({"eval_time": "32m", "alertname": "KilnStalenessNearTau", "exp_alerts": [
        {"exp_labels": {"severity": "warning", **BAD}},
        {"exp_labels": {"severity": "warning", **RETUNED}}]})
    cases.append({"eval_time": "10m", "alertname": "KilnBufferWriteFailing", "exp_alerts": [
        {"exp_labels": {"severity": "critical", "errno": "ENOSPC", **BAD}}]})
    cases.append({"eval_time": "25m", "alertname": "KilnCallersRefused", "exp_alerts": [
        {"exp_labels": {"severity": "warning", "method": "/kiln.v1.WeightSync/Publish", **BAD}}]})
    # One skipped update fires at once, and clears once it is out of the window.
    cases.append({"eval_time": "5m", "alertname": "KilnTrainerNonFiniteSteps", "exp_alerts": []})
    cases.append({"eval_time": "12m", "alertname": "KilnTrainerNonFiniteSteps", "exp_alerts": [
        {"exp_labels": {"severity": "warning", "stage": "rl", "reason": "loss", **BAD}}]})
    cases.append({"eval_time": "35m", "alertname": "KilnTrainerNonFiniteSteps", "exp_alerts": []})
    cases.append({"eval_time": "30m", "alertname": "KilnCertificateExpiring", "exp_alerts": []})
    cases.append({"eval_time": "90m", "alertname": "KilnCertificateExpiring", "exp_alerts": [
        {"exp_labels": {"severity": "critical", "component": "buffer", **BAD}}]})
    keep = {"KilnRatioMaskFractionHigh", "KilnTrainingStalled"}
    groups = yaml.safe_load(rules_file.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            if rule["alert"] not in keep:
                rule.pop("annotations")
    stripped = rules_file.parent / "kiln-alerts.labels-only.yaml"
    stripped.write_text(yaml.safe_dump({"groups": groups}))
    test = {"rule_files": [stripped.name], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}
    test_file = rules_file.parent / "kiln-alerts.test.yaml"
    test_file.write_text(yaml.safe_dump(test, sort_keys=False))
    out = run(PROMTOOL, "test", "rules", test_file.name, cwd=rules_file.parent)
    assert "SUCCESS" in out


# ------------------------------------------------------------------------------- dashboard

def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and every query variable."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), *\w+\)", var["definition"])
            assert inner, var["definition"]
            out.append((f"variable {var['name']}", inner.group(1)))
    return out


def substitute(expr: str, namespace: str, rljob: str, rate: str) -> str:
    out = (expr.replace("$__rate_interval", rate).replace("$namespace", namespace)
           .replace("$rljob", rljob))
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out


def test_dashboard_covers_the_drift_metrics() -> None:
    exprs = " ".join(e for _, e in dashboard_queries())
    from kiln.services.common import metrics

    for metric in (metrics.POLICY_VERSION, metrics.STALENESS, metrics.RATIO_MASK_FRACTION,
                   metrics.ICEPOP_MASK_FRACTION, metrics.MISMATCH_ABS, metrics.MISMATCH_KL,
                   metrics.SYNC_SECONDS, metrics.BUFFER_DEPTH, metrics.ROLLOUT_TOKENS,
                   metrics.SANDBOX_START_SECONDS, metrics.SANDBOX_FAILURES, metrics.REWARD_MEAN,
                   metrics.ROUTING_FLIP_FRACTION, metrics.SWARM_SUBAGENTS,
                   metrics.SWARM_CRITICAL_PATH, metrics.SWARM_TOTAL_STEPS, metrics.FRESHNESS_TAU,
                   metrics.RATIO_ONLY_MASK_FRACTION, metrics.ICEPOP_ONLY_MASK_FRACTION,
                   metrics.BOTH_MASKS_FRACTION, metrics.KL_REF, metrics.DENSE_KL,
                   metrics.TEACHER_SCORE_SECONDS, metrics.REWARD_MODEL_SECONDS):
        assert metric._name in exprs, metric._name
    known = {m._name for m in vars(metrics).values() if hasattr(m, "_name")}
    used = set(re.findall(r"\bkiln_[a-z_]+", exprs))
    stems = {re.sub(r"_(bucket|count|sum|total)$", "", u) for u in used}
    assert stems <= known | {k.removesuffix("_total") for k in known}, stems - known


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = [{"record": f"kiln:dashboard:q{i}", "expr": substitute(e, ".*", ".*", "5m")}
             for i, (_, e) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run(PROMTOOL, "check", "rules", path)
    assert f"SUCCESS: {len(rules)} rules found" in out


EXPORTER = textwrap.dedent("""
    import sys, time
    from prometheus_client import start_http_server
    from kiln.services.common import metrics as m

    def tick(i):
        for c in ("trainer", "rollout", "weight-sync"):
            m.POLICY_VERSION.labels(c).set(10 + i)
        m.STALENESS.observe(i % 4)
        m.DROPPED_STALE.inc()
        m.RATIO_MASK_FRACTION.set(0.05)
        m.ICEPOP_MASK_FRACTION.set(0.01)
        m.MISMATCH_ABS.set(0.002)
        m.MISMATCH_KL.set(0.0004)
        m.TRAIN_STEP.labels("rl").set(i)
        m.TRAIN_LOSS.labels("rl").set(1.0 / (i + 1))
        m.STEP_SECONDS.observe(0.3)
        m.TRAINER_IDLE_SECONDS.inc(0.1)
        m.REWARD_MEAN.set(0.5)
        m.SYNC_SECONDS.observe(0.2)
        m.SYNC_BYTES.inc(1 << 20)
        m.SYNC_FAILURES.labels("checksum").inc(0)
        m.BUFFER_DEPTH.set(40 + i)
        m.ACCEPTED.inc(8)
        m.SERVED.inc(8)
        m.ROLLOUT_TOKENS.inc(500)
        m.EPISODES.labels("finished").inc()
        m.EPISODES.labels("stale").inc()
        m.ROLLOUT_ENGINE_IDLE.inc(0.05)
        m.EPISODE_REWARD.observe(1.0)
        m.SANDBOX_START_SECONDS.labels("bubblewrap").observe(0.01)
        m.SANDBOX_FAILURES.labels("bubblewrap", "timeout").inc()
        m.SANDBOX_ACTIVE.labels("bubblewrap").set(3)
        m.SWARM_SUBAGENTS.observe(i % 5)
        m.SWARM_CRITICAL_PATH.observe(9)
        m.SWARM_TOTAL_STEPS.observe(17)
        m.FRESHNESS_TAU.labels("rl").set(4)
        m.RATIO_ONLY_MASK_FRACTION.set(0.03)
        m.ICEPOP_ONLY_MASK_FRACTION.set(0.005)
        m.BOTH_MASKS_FRACTION.set(0.005)
        m.CORRECTION_MASK_FRACTION.set(0.01)
        m.KL_REF.set(0.02)
        m.DENSE_KL.set(0.3)
        m.ROUTING_FLIP_FRACTION.set(0.04)
        m.ROUTING_STRADDLE_FRACTION.set(0.001)
        m.GRAD_NORM.set(1.5)
        m.BUFFER_LEASED.set(16)
        m.BATCHES_REDELIVERED.inc(0)
        m.TEACHER_SCORE_SECONDS.observe(0.4)
        m.REWARD_MODEL_SECONDS.observe(1.2)
        m.TEACHER_SCORED_TOKENS.inc(300)
        m.JUDGE_UNPARSED.inc(0)

    server, _ = start_http_server(0, addr="127.0.0.1")
    print(server.server_port, flush=True)
    i = 0
    while True:
        tick(i)
        i += 1
        time.sleep(0.25)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def prometheus(tmp_path: Path) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 scraping a process that exports Kiln metrics every 0.5 s, with
    the target labels the PodMonitor gives job pods (namespace, rljob)."""
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER], stdout=subprocess.PIPE, text=True)
    prom = None
    try:
        port = int(exporter.stdout.readline())
        config = {"global": {"scrape_interval": "500ms", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "kiln", "static_configs": [{
                      "targets": [f"127.0.0.1:{port}"],
                      "labels": {"namespace": "kiln-test", "rljob": "demo"}}]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        web = _free_port()
        prom = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{web}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if _query(url, 'count(kiln_buffer_depth{rljob="demo"})'):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("Prometheus did not scrape the exporter within 20 s")
        time.sleep(2.0)  # several scrapes, so rates have two samples in their window
        yield url
    finally:
        for proc in (prom, exporter):
            if proc is not None:
                proc.terminate()
                proc.wait(10)


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    full = f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(full, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
def test_dashboard_queries_return_data_from_a_live_prometheus(prometheus: str) -> None:
    empty = []
    for title, expr in dashboard_queries():
        result = _query(prometheus, substitute(expr, "kiln-test", "demo", "5s"))
        if not result:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    # The variables select by the labels a job's series carry; another job's name finds nothing.
    assert _query(prometheus, substitute(dashboard_queries()[0][1], "kiln-test", "other", "5s")) == []
