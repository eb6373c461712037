"""The Grafana dashboard the chart ships (`charts/kiln/files/kiln-off-policy-drift.json`), built
from the metric registry so that its queries, units and descriptions cannot drift from it.

A panel here names what it plots as registry metrics and a view of each (its value, its rate,
a quantile or mean of a histogram, its buckets); the PromQL, the Grafana unit (derived from the
registry's unit and the view: a rate of seconds is a fraction of time, a rate of anything else a
count per second) and the description (the panel's own lead plus the registry's help of every
series it plots) follow. A panel whose plots differ in unit gets a per-query unit override.

Regenerate after changing a panel or a metric's help or unit:
`python -m kiln.dashboard > charts/kiln/files/kiln-off-policy-drift.json`
(tests/unit/test_dashboard.py checks the file is current and its units agree with the registry).

Not covered: the alerts (charts/kiln/templates/prometheusrule.yaml) and the series themselves
(`kiln.metrics`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kiln.metrics import ALL, Metric

View = Literal["value", "rate", "quantile", "mean", "buckets"]

JOB = 'namespace=~"$namespace", rljob=~"$rljob"'
"""Every query selects the RLJobs picked in the dashboard's variables (labels the PodMonitor
gives job pods)."""

VALUE_UNITS = {"fraction": "percentunit", "seconds": "s", "bytes": "bytes",
               "tokens/s": "ops"}
"""Grafana unit of a value in a registry unit; other units (versions, trajectories, nats, loss)
are plain numbers, `short`."""


def grafana_unit(m: Metric, view: View) -> str:
    """The Grafana unit of `m` shown as `view`."""
    if view == "rate":
        # Seconds per second: the fraction of the time spent so (idle, waiting).
        return {"seconds": "percentunit", "bytes": "Bps", "calls": "reqps"}.get(m.unit, "ops")
    if view == "buckets":
        return "short"
    return VALUE_UNITS.get(m.unit, "short")


@dataclass(frozen=True)
class Plot:
    metric: str
    """A name in `kiln.metrics.ALL` (exported as a series)."""
    legend: str
    view: View = "value"
    by: tuple[str, ...] = ()
    agg: str = ""
    """Aggregation across pods: `max` for a value, `sum` for a rate unless set."""
    q: float = 0.5
    match: str = ""
    """Extra label matchers, e.g. `outcome="stale"`."""

    def expr(self) -> str:
        m = ALL[self.metric]
        assert m.series, f"{self.metric} has no series"
        sel = f"{{{self.match + ', ' if self.match else ''}{JOB}}}"
        by = f" by ({', '.join(self.by)})" if self.by else ""
        if self.view == "value":
            return f"{self.agg or 'max'}{by} ({m.series}{sel})"
        if self.view == "rate":
            return f"{self.agg or 'sum'}{by} (rate({m.series}{sel}[$__rate_interval]))"
        le = f" by ({', '.join((*self.by, 'le'))})"
        if self.view == "quantile":
            return (f"histogram_quantile({self.q}, sum{le} "
                    f"(rate({m.series}_bucket{sel}[$__rate_interval])))")
        if self.view == "mean":
            return (f"sum{by} (rate({m.series}_sum{sel}[$__rate_interval])) / "
                    f"sum{by} (rate({m.series}_count{sel}[$__rate_interval]))")
        return f"sum{le} (increase({m.series}_bucket{sel}[$__rate_interval]))"


@dataclass(frozen=True)
class Panel:
    title: str
    lead: str
    """What the panel shows and how to read it; the series' own help follows it."""
    plots: tuple[Plot, ...]
    kind: Literal["timeseries", "heatmap"] = "timeseries"
    stacked: bool = False


def _p(title: str, lead: str, *plots: Plot, **kw: Any) -> Panel:
    return Panel(title, lead, plots, **kw)


def _quantiles(metric: str, what: str, by: tuple[str, ...] = (), suffix: str = "") -> tuple[Plot, ...]:
    return tuple(Plot(metric, " ".join(w for w in (f"p{int(q * 100)}", what, suffix) if w),
                      "quantile", by, q=q) for q in (0.5, 0.9))


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Policy versions and freshness", (
        _p("Policy version per component", "The version each component holds; the gap between "
           "the trainer and rollout is the off-policy lag.",
           Plot("policy_version", "{{component}}", by=("component",))),
        _p("Trajectory staleness (versions behind the trainer)", "How many versions behind the "
           "trainer the trajectories served for training are, per interval.",
           Plot("trajectory_staleness", "{{le}}", "buckets"), kind="heatmap"),
        _p("Staleness against tau", "Staleness quantiles beside the running stage's freshness "
           "bound tau: a p90 close to tau means rollout lags and data will soon be dropped "
           "(alert KilnStalenessNearTau).",
           *_quantiles("trajectory_staleness", "staleness"),
           Plot("freshness_tau", "tau ({{stage}})", by=("stage",))),
        _p("Stale drops", "Work lost to freshness control: trajectories the buffer dropped and "
           "episodes rollout stopped because they fell more than tau behind.",
           Plot("dropped_stale", "trajectories dropped stale", "rate"),
           Plot("episodes", "episodes stopped beyond tau", "rate", match='outcome="stale"')),
        _p("Buffer depth", "Trajectories waiting to be trained on and those leased in served "
           "batches not yet acknowledged.",
           Plot("buffer_depth", "waiting", agg="sum"), Plot("buffer_leased", "leased", agg="sum")),
        _p("Buffer throughput", "Trajectories in and out of the buffer, and batches served again "
           "after a lease ran out (a trainer restart or a slow step).",
           Plot("accepted", "accepted", "rate"), Plot("served", "served", "rate"),
           Plot("batches_redelivered", "batches redelivered", "rate")),
    )),
    ("Off-policy correction and KL", (
        _p("Mask fractions", "Fraction of trained tokens each mask takes out of the gradient "
           "(a token may be masked by both).",
           Plot("ratio_mask_frac", "ratio mask"), Plot("icepop_mask_frac", "IcePop mask"),
           Plot("correction_mask_frac", "rollout correction mask")),
        _p("Masked tokens by mask (exclusive)", "The masked tokens split by which masks took "
           "them: stacked, the three add up to all tokens the ratio mask and IcePop drop.",
           Plot("ratio_only_frac", "ratio mask only"), Plot("icepop_only_frac", "IcePop only"),
           Plot("both_masked_frac", "both masks"), stacked=True),
        _p("Train / inference log-prob mismatch", "How differently the training and inference "
           "engines score the same tokens under the same weights; it should stay near zero "
           "(alert KilnTrainInferenceMismatchHigh).",
           Plot("mismatch_abs", "mean |diff|"), Plot("mismatch_kl", "KL(infer || train)")),
        _p("KL to the reference and to the teacher", "The KL penalty's estimate (rl.klCoef) and "
           "the dense distillation term; each is absent where the stage does not use it.",
           Plot("kl_ref", "KL(policy || reference)"), Plot("dense_kl", "dense KL to the teacher")),
        _p("MoE routing", "Mixture-of-experts models: how often the trainer routes a token to "
           "other experts than rollout did, and tokens left out because their recorded routing "
           "is of a newer version.",
           Plot("routing_flip_frac", "routing flips"),
           Plot("routing_straddle_frac", "left out (routing straddles versions)")),
    )),
    ("Weight sync", (
        _p("Weight-sync latency", "Publish-to-applied time of a weight version on a rollout "
           "replica (alert KilnWeightSyncSlow).", *_quantiles("sync_seconds", "")),
        _p("Weight-sync throughput", "Weight bytes streamed to rollout replicas.",
           Plot("sync_bytes", "bytes streamed", "rate")),
        _p("Weight-sync failures", "Weight transfers rollout replicas rejected, by reason; "
           "replicas keep the old weights meanwhile (alert KilnWeightSyncFailing).",
           Plot("sync_failures", "{{reason}}", "rate", ("reason",))),
    )),
    ("Rollout and scoring", (
        _p("Tokens per second", "Tokens rollout generates and the trainer trains on.",
           Plot("rollout_tokens", "rollout (generated)", "rate"),
           Plot("tokens_per_second", "trainer")),
        _p("Episodes", "Finished episodes per second, by outcome.",
           Plot("episodes", "{{outcome}}", "rate", ("outcome",))),
        _p("Reward", "Mean reward of the last training batch, and the median reward of the "
           "episodes rollout finishes.",
           Plot("reward_mean", "training batch mean"),
           Plot("episode_reward", "rollout episode p50", "quantile")),
        _p("Idle fraction", "Fraction of the time the trainer waits for a batch and the rollout "
           "engines have no request in progress (mean of replicas): what autoscaling reads.",
           Plot("wait_seconds", "trainer waiting for data", "rate"),
           Plot("engine_idle_seconds", "rollout engine idle", "rate", agg="avg")),
        _p("Teacher scoring", "On-policy distillation: time for the teacher to score a group of "
           "trajectories, and the tokens it scores per second.",
           *_quantiles("teacher_score_seconds", "teacher"),
           Plot("teacher_scored_tokens", "tokens scored", "rate")),
        _p("Reward-model and judge scoring", "Time to score one episode with its task set's "
           "outcome model and judge (rewardRules), and the judge's verdicts that could not be "
           "read (scored 0).", *_quantiles("reward_model_seconds", "reward model"),
           Plot("judge_unparsed", "unreadable verdicts", "rate")),
    )),
    ("Sandboxes", (
        _p("Sandbox start latency", "Time to create a sandbox, per backend.",
           *_quantiles("sandbox_start_seconds", "", ("backend",), "{{backend}}")),
        _p("Sandbox failures", "Sandbox operations that failed, per backend and reason "
           "(alert KilnSandboxFailuresHigh).",
           Plot("sandbox_failures", "{{backend}} {{reason}}", "rate", ("backend", "reason"))),
        _p("Active sandboxes", "Sandboxes alive, per backend.",
           Plot("sandbox_active", "{{backend}}", by=("backend",), agg="sum")),
    )),
    ("Training", (
        _p("Training step", "Optimizer steps taken (alert KilnTrainingStalled).",
           Plot("step", "{{stage}}", by=("stage",))),
        _p("Loss", "Loss of the last optimizer step, per stage.",
           Plot("loss", "{{stage}}", by=("stage",))),
        _p("Gradient norm", "Gradient norm of the last optimizer step, before clipping.",
           Plot("grad_norm", "grad norm")),
        _p("Step time", "Wall time of one optimizer step.", *_quantiles("step_seconds", "step")),
    )),
    ("Agent swarms", (
        _p("Swarm: critical path vs total model calls per episode", "The critical path is the "
           "longest chain of dependent model calls (the orchestrator's and, per parallel wave, "
           "its slowest subagent's); the total counts every model call. Their gap is the "
           "parallelism the swarm achieved.",
           Plot("swarm_critical_path_steps", "critical path p50", "quantile"),
           Plot("swarm_total_steps", "total p50", "quantile"),
           Plot("swarm_critical_path_steps", "critical path mean", "mean")),
        _p("Swarm: subagents per episode", "Subagents each orchestrator episode created.",
           Plot("swarm_subagents", "mean", "mean"),
           Plot("swarm_subagents", "p90", "quantile", q=0.9)),
    )),
)


def _description(panel: Panel) -> str:
    lines = [panel.lead, ""]
    seen = set()
    for p in panel.plots:
        m = ALL[p.metric]
        if m.series not in seen:
            seen.add(m.series)
            lines.append(f"- `{m.series}` ({m.unit}): {m.help}.")
    return "\n".join(lines)


DS = {"type": "prometheus", "uid": "${datasource}"}


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    units = [grafana_unit(ALL[p.metric], p.view) for p in panel.plots]
    targets = []
    for i, p in enumerate(panel.plots):
        t = {"refId": chr(ord("A") + i), "expr": p.expr(), "legendFormat": p.legend,
             "datasource": DS}
        if panel.kind == "heatmap":
            t["format"] = "heatmap"
        targets.append(t)
    out: dict[str, Any] = {
        "id": pid, "type": panel.kind, "title": panel.title,
        "description": _description(panel), "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": 12, "h": 8},
    }
    if panel.kind == "heatmap":
        out["fieldConfig"] = {"defaults": {"unit": units[0]}, "overrides": []}
        out["options"] = {"calculate": False, "cellGap": 1,
                          "yAxis": {"unit": VALUE_UNITS.get(ALL[panel.plots[0].metric].unit, "short")}}
    else:
        defaults: dict[str, Any] = {"unit": units[0]}
        if panel.stacked:
            defaults["custom"] = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 40}
        overrides = [{"matcher": {"id": "byFrameRefID", "options": t["refId"]},
                      "properties": [{"id": "unit", "value": u}]}
                     for t, u in zip(targets, units) if u != units[0]]
        out["fieldConfig"] = {"defaults": defaults, "overrides": overrides}
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                          "tooltip": {"mode": "multi"}}
    out["targets"] = targets
    return out


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {},
            "hide": 0}


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    version = ALL["policy_version"].series
    panels: list[dict[str, Any]] = []
    y = n = 0
    for r, (title, row) in enumerate(ROWS):
        panels.append({"id": 100 + r, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1
        for i, panel in enumerate(row):
            n += 1
            panels.append(_panel(panel, n, 12 * (i % 2), y + 8 * (i // 2)))
        y += 8 * ((len(row) + 1) // 2)
    return {
        "uid": "kiln-off-policy-drift",
        "title": "Kiln / Off-policy drift",
        "description": "Staleness, masks, KL, train/inference mismatch, weight sync, rollout, "
                       "scoring, sandboxes and training of Kiln RLJobs.",
        "tags": ["kiln", "rl"], "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "30s", "time": {"from": "now-3h", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            _variable("namespace", "Namespace", f"label_values({version}, namespace)"),
            _variable("rljob", "RLJob",
                      f'label_values({version}{{namespace=~"$namespace"}}, rljob)'),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
