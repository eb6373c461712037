"""The operator's side of driving: run state kept in the RLJob's status (camelCase, as the CRD
schema has it), the address map consulted before the template, the model made by an init
container when the spec asks for one."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.api.spec import RLJob
from kiln.control.driver import RunState
from kiln.operator.driving import StatusStore
from kiln.operator.naming import JobRef
from kiln.operator.status import Addresses
from kiln.operator.workloads import workloads

JOB = JobRef(name="j", namespace="ns", uid="u")


class StatusKube:
    """The one call StatusStore makes, applied to a dict as the API server would (merge)."""

    def __init__(self) -> None:
        self.status: dict = {}

    def merge_patch_status(self, ref: dict, status: dict) -> None:
        assert ref["metadata"] == {"name": "j", "namespace": "ns"}
        for key, value in status.items():
            if isinstance(value, dict):
                self.status.setdefault(key, {}).update(value)
            else:
                self.status[key] = value


def test_run_state_round_trips_through_the_status_in_camel_case() -> None:
    kube = StatusKube()
    store = StatusStore(kube, JOB, lambda: kube.status)
    state = RunState.load(store)
    assert state.finished_stages == [] and state.evaluations == {}
    state.finished_stages.append("sft")
    # What the stage driver stores: the control plane's record as it records it, every field of
    # it (a field the status model lacks would fail the save and stall the job).
    from kiln.control import Evaluation
    from kiln.evaluation import TaskCount

    counts = [TaskCount("a", 2, 1, True), TaskCount("b", 2, 0, False)]
    state.evaluations["rl/before/h"] = Evaluation(3, 8, 0.25, 0.5, 1.5, 17.0,
                                                  task_counts=counts).recorded()
    state.save()
    assert kube.status["finishedStages"] == ["sft"]
    assert kube.status["evaluations"]["rl/before/h"] == {
        "policyVersion": 3, "tasks": 8, "greedySuccess": 0.25, "sampledSuccess": 0.5,
        "seconds": 1.5, "criticalPathSteps": 17.0, "criticalPathStepsAnswered": 0.0,
        "passAtK": {"1": 0.25, "2": 0.5}}
    # A guarded stage's selected checkpoint, and why, goes to status.selections.
    state.selections["rl"] = {"step": 10, "reason": "stopped on regression", "stopped": True}
    state.save()
    assert kube.status["selections"] == {"rl": {"step": 10, "reason": "stopped on regression",
                                                "stopped": True}}
    again = RunState.load(StatusStore(kube, JOB, lambda: kube.status))
    assert again.finished_stages == ["sft"]
    assert again.evaluations["rl/before/h"]["greedy_success"] == 0.25
    assert again.selections == state.selections


def test_address_map_wins_over_the_template_and_is_reread(tmp_path: Path) -> None:
    path = tmp_path / "addresses.json"
    addresses = Addresses("{name}-{component}.{namespace}.svc:50051", str(path))
    assert addresses(JOB, "trainer") == "j-trainer.ns.svc:50051"  # no map yet
    path.write_text(json.dumps({"ns/j-trainer": "127.0.0.1:4000"}))
    assert addresses(JOB, "trainer") == "127.0.0.1:4000"
    assert addresses(JOB, "rollout") == "j-rollout.ns.svc:50051"


def _job(init: bool) -> RLJob:
    model = {"path": "m", **({"init": {"hiddenSize": 32, "numLayers": 1}} if init else {})}
    return RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
        "spec": {"model": model, "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["t"], "batchSize": 8,
                             "microBatchSize": 8, "rl": {"groupSize": 8}}]}})


def test_model_init_runs_as_an_init_container_of_trainer_and_rollout() -> None:
    hashes = dict.fromkeys(("trainer", "rollout", "sandbox", "weight-sync", "buffer"), "h")
    made = {w["metadata"]["name"]: w["spec"]["template"]["spec"].get("initContainers", [])
            for w in workloads(JOB, _job(True).spec, hashes, active=True)}
    for name in ("j-trainer", "j-rollout"):
        (init,) = made[name]
        assert init["command"] == ["kiln", "prepare-model", "--job", "/etc/kiln/job.yaml"]
    assert made["j-buffer"] == [] and made["j-weight-sync"] == []
    plain = {w["metadata"]["name"]: w["spec"]["template"]["spec"].get("initContainers", [])
             for w in workloads(JOB, _job(False).spec, hashes, active=True)}
    assert plain["j-trainer"] == [] and plain["j-rollout"] == []


def test_a_hub_model_is_downloaded_onto_the_model_volume_with_the_secrets_token() -> None:
    hashes = dict.fromkeys(("trainer", "rollout", "sandbox", "weight-sync", "buffer"), "h")
    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
        "spec": {"model": {"path": "qwen3-8b", "pvc": "models",
                           "hub": {"id": "Qwen/Qwen3-8B", "tokenSecret": "hf-token"}},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["t"], "batchSize": 8,
                             "microBatchSize": 8, "rl": {"groupSize": 8}}]}})
    pods = {w["metadata"]["name"]: w["spec"]["template"]["spec"]
            for w in workloads(JOB, job.spec, hashes, active=True)}
    for name in ("j-trainer", "j-rollout"):
        pod = pods[name]
        (init,) = pod["initContainers"]
        assert init["command"] == ["kiln", "prepare-model", "--job", "/etc/kiln/job.yaml"]
        env = {e["name"]: e for e in init["env"]}
        # The token reaches the download alone, from the Secret; never the service.
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert env["KILN_MODEL_ROOT"]["value"] == "/models"
        mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
        assert not mounts["/models"].get("readOnly")  # the download writes there
        assert "/var/lib/kiln" in mounts and init["workingDir"] == "/var/lib/kiln"
        (service,) = pod["containers"]
        assert "HF_TOKEN" not in {e["name"] for e in service["env"]}
        assert {m["mountPath"]: m.get("readOnly") for m in service["volumeMounts"]}["/models"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
    # A model only read keeps a read-only claim.
    plain = job.model_copy(deep=True)
    plain.spec.model.hub = None
    pod = {w["metadata"]["name"]: w["spec"]["template"]["spec"]
           for w in workloads(JOB, plain.spec, hashes, active=True)}["j-trainer"]
    assert "initContainers" not in pod
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True


class FailingControls:
    """The job's services as the driver sees them through `Controls`: a trainer that fails in
    its first stage after `steps` polls, a rollout at its version, a buffer."""

    def __init__(self, steps: int = 2) -> None:
        from kiln.control import RolloutStatus, TrainerStatus

        self.closed, self.polls, self.stage = False, 0, ""
        self.scalars: list[dict] = []
        controls = self

        class Trainer:
            def record_scalars(self, step: int, scalars: dict) -> None:
                controls.scalars.append(scalars)

            def start_stage(self, name: str):
                controls.stage = name
                return self.status()

            def status(self):
                controls.polls += 1
                failed = bool(controls.stage) and controls.polls > steps
                return TrainerStatus(policy_version=0, stage=controls.stage, stage_failed=failed,
                                     message="CUDA error: out of memory" if failed else "")

        class Rollout:
            def status(self):
                return RolloutStatus()

            def set_mode(self, mode):
                return RolloutStatus(mode.mode, mode.stage)

            def serving(self) -> int:
                return 1

        class Buffer:
            def status(self):
                from helpers.fakes import FakeBufferStatus
                return FakeBufferStatus()

        self.trainer, self.rollout, self.buffer = Trainer(), Rollout(), Buffer()

    def close(self) -> None:
        self.closed = True


def test_a_stage_the_trainer_failed_makes_the_job_failed_with_the_reason(monkeypatch) -> None:
    """The operator's driving loop on a job whose trainer reports its stage failed: the RLJob's
    phase becomes Failed (not left Running, which nothing would ever change), the reason is in
    the message and the Driving condition, no stage is recorded done, and the clients close."""
    import threading

    from kiln.operator import driving

    kube = StatusKube()
    kube.status = {"phase": "Running", "conditions": [
        {"type": "Driving", "status": "True", "reason": "Driving", "message": "",
         "lastTransitionTime": "2020-01-01T00:00:00Z"}]}
    controls = FailingControls()
    monkeypatch.setattr(driving.Controls, "open", classmethod(lambda cls, *a, **k: controls))
    outcome = driving.drive(_job(False), JOB, kube, lambda component: "unused:0",
                            lambda: kube.status, threading.Event(),
                            lambda: controls.polls > 200,  # a driver deaf to the failure stops
                            poll_seconds=0.0)
    assert outcome == "failed"
    assert kube.status["phase"] == "Failed"
    assert kube.status["message"] == "driver: trainer failed in stage rl: CUDA error: out of memory"
    (driving_condition,) = [c for c in kube.status["conditions"] if c["type"] == "Driving"]
    assert (driving_condition["status"], driving_condition["reason"]) == ("False", "StageFailed")
    assert "CUDA error: out of memory" in driving_condition["message"]
    assert not kube.status.get("finishedStages") and controls.closed


def test_with_an_output_the_drivers_tensorboard_scalars_go_to_the_trainer(monkeypatch,
                                                                          tmp_path) -> None:
    """TensorBoard of the operator's driver: with `spec.output` its scalars go to the trainer
    (which writes them into the output location), none into the operator's folder; without,
    into the operator's folder, none to the trainer."""
    import threading

    from kiln.operator import driving

    for output, sent, local in ((None, False, True), ({"pvc": {"claim": "results"}}, True, False)):
        kube, controls = StatusKube(), FailingControls(steps=4)
        monkeypatch.setattr(driving.Controls, "open", classmethod(lambda cls, *a, **k: controls))
        job = _job(False)
        job.spec.output = None if output is None else type(job.spec).model_validate(
            {**job.spec.model_dump(by_alias=True, exclude_none=True), "output": output}).output
        folder = tmp_path / ("out" if output else "plain")
        driving.drive(job, JOB, kube, lambda component: "unused:0", lambda: kube.status,
                      threading.Event(), lambda: controls.polls > 200, poll_seconds=0.0,
                      tracking_dir=folder)
        assert bool(controls.scalars) is sent
        assert any("progress/steps_left" in s for s in controls.scalars) is sent
        assert any(folder.rglob("events.out.tfevents.*")) is local
