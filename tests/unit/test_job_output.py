"""A job's output (`spec.output`, `kiln.api.outputs`): the spec refuses a folder outside its
claim and a half-given S3 location; the operator mounts the output PVC into the trainer's
replica 0 alone (the one that writes each stage's model there), or gives it the S3 endpoint and
the credentials by Secret reference, and tells it where; the trainer's writer uploads each
stage's model and the summary to a real S3 server (moto's, on loopback) and `kiln export`
downloads it from there; `kiln export` copies a stage's model from an output folder and says
what is there when the stage is not; `kiln run` refuses an output it cannot reach, writing
nothing.

The trainer's writing to a folder, and `kiln export` reading a model it wrote, are
`test_trainer_servicer.py`'s (a real stage). Manifests are checked against Kubernetes' own
schemas; nothing here needs a cluster.
"""
from __future__ import annotations

import argparse
import io
import json
import socket
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kiln.api.outputs import OUTPUT_DIR_ENV, OUTPUT_ROOT
from kiln.api.spec import RLJob
from kiln.api.validate import validate_text
from kiln.cli.local.preflight import prepare
from kiln.cli.main import main
from kiln.operator import children
from kiln.services.trainer.output import write_stage_output, write_tensorboard

from helpers.operator_jobs import JOB, SMALL, spec, workload

OUTPUT = {"pvc": {"claim": "results", "path": "team/run-1"}}


def _job_text(**spec_changes) -> str:
    return yaml.safe_dump({"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob",
                           "metadata": {"name": "j"}, "spec": {**SMALL, **spec_changes}})


@pytest.mark.parametrize("output, field, message", [
    ({"pvc": {"claim": "results", "path": "../other-team"}}, "spec.output.pvc",
     "relative to the volume's root, without '..'"),
    ({"pvc": {"claim": "results", "path": "/abs"}}, "spec.output.pvc", "relative"),
    ({"pvc": {"path": "x"}}, "spec.output.pvc.claim", "required"),
    ({"s3": "bucket"}, "spec.output", "s3"),
    ({"pvc": {"claim": "results"}, "uri": "s3://bucket/x"}, "spec.output",
     "exactly one of pvc or uri"),
    ({"pvc": {"claim": "results"}, "endpoint": "http://minio:9000"}, "spec.output",
     "endpoint: only with uri"),
    ({"uri": "gs://bucket/x"}, "spec.output.uri", "pattern"),
], ids=["dotdot", "absolute", "no-claim", "unknown", "both", "endpoint-with-pvc", "not-s3"])
def test_a_bad_output_is_refused_by_field(output: dict, field: str, message: str) -> None:
    _, problems = validate_text(_job_text(output=output), file="j.yaml")
    assert any(p.path.startswith(field) and message in f"{p.path} {p.message}"
               for p in problems), problems


def test_the_output_volume_reaches_trainer_replica_zero_only() -> None:
    objs = children.desired_children(JOB, spec(SMALL, output=OUTPUT, trainer={"dataParallel": 2}))
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    by = {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}
    trainer = workload(objs, "trainer")["spec"]["template"]["spec"]
    assert {"name": "output", "persistentVolumeClaim": {"claimName": "results"}} in trainer["volumes"]
    (c,) = trainer["containers"]
    assert {"name": "output", "mountPath": OUTPUT_ROOT} in c["volumeMounts"]
    assert {"name": OUTPUT_DIR_ENV, "value": f"{OUTPUT_ROOT}/team/run-1"} in c["env"]
    others = [o for name, o in by.items() if o["kind"] in ("Deployment", "StatefulSet")
              and name != "StatefulSet/demo-trainer"]
    assert "StatefulSet/demo-trainer-replica" in by and len(others) >= 5
    for obj in others:
        pod = obj["spec"]["template"]["spec"]
        assert "output" not in {v["name"] for v in pod["volumes"]}, obj["metadata"]["name"]
        assert all(OUTPUT_DIR_ENV not in {e["name"] for e in c.get("env", [])}
                   for c in pod["containers"])


def _output_folder(root: Path) -> Path:
    """An output folder as the trainer leaves it after stages sft and rl."""
    for stage in ("sft", "rl"):
        (root / "stages" / stage).mkdir(parents=True)
        (root / "stages" / stage / "config.json").write_text(json.dumps({"stage": stage}))
    (root / "final-hf").mkdir()
    (root / "final-hf" / "config.json").write_text(json.dumps({"stage": "rl"}))
    (root / "summary.json").write_text(json.dumps({"final_stage": "rl"}))
    return root


def test_kiln_export_copies_a_stage_from_an_output_folder(tmp_path: Path, capsys) -> None:
    output = _output_folder(tmp_path / "output")
    assert main(["export", str(output), "--out", str(tmp_path / "final")]) == 0
    assert json.loads((tmp_path / "final" / "config.json").read_text()) == {"stage": "rl"}
    assert main(["export", str(output), "--stage", "sft", "--out", str(tmp_path / "sft")]) == 0
    assert json.loads((tmp_path / "sft" / "config.json").read_text()) == {"stage": "sft"}
    capsys.readouterr()
    assert main(["export", str(output), "--stage", "rll", "--out", str(tmp_path / "x")]) == 1
    assert "finished stages there: rl, sft" in capsys.readouterr().err
    assert main(["export", str(output), "--step", "3", "--out", str(tmp_path / "x")]) == 1
    assert "--step" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # Not over a folder that holds files, unless told.
    assert main(["export", str(output), "--out", str(tmp_path / "sft")]) == 1


def test_kiln_run_refuses_an_output_volume_and_writes_nothing(tmp_path: Path) -> None:
    data = yaml.safe_load(_job_text(output=OUTPUT))
    data["spec"]["model"]["init"] = {"hiddenSize": 32}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    err = io.StringIO()
    code = prepare(argparse.Namespace(job=job, run_dir=tmp_path / "run", resume=None),
                   io.StringIO(), err)
    assert code == 1 and "spec.output.pvc: the PersistentVolumeClaim 'results'" in err.getvalue()
    assert not (tmp_path / "run").exists()


def test_an_s3_output_gets_its_endpoint_and_credentials_by_reference() -> None:
    output = {"uri": "s3://models/team/run-1", "endpoint": "http://minio.storage:9000",
              "credentialsSecret": "s3-creds"}
    objs = children.desired_children(JOB, spec(SMALL, output=output))
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    trainer = workload(objs, "trainer")["spec"]["template"]["spec"]
    assert "output" not in {v["name"] for v in trainer["volumes"]}
    env = {e["name"]: e for e in trainer["containers"][0]["env"]}
    assert env[OUTPUT_DIR_ENV]["value"] == "s3://models/team/run-1"
    assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://minio.storage:9000"
    assert env["AWS_SECRET_ACCESS_KEY"] == {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {
        "secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY", "optional": False}}}
    # The keys stay in the Secret: nothing of them in the job's ConfigMap.
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(config)


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on loopback (a real HTTP S3 API; no AWS is reached)."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _export(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _tokenizer() -> dict[str, str]:
    """A small word-level tokenizer's files, as an export holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "add": 1, "hello": 2, "world": 3},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return {"tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})}


def _trajectory():
    from kiln.trajectory import Trajectory, VersionSpan

    return Trajectory(id="traj-1", task_id="add-1", group_id="g", tokens=[1, 2, 3],
                      loss_mask=[0, 1, 1], logp_infer=[0.0] * 3, prompt_len=1,
                      version_spans=[VersionSpan(1, 3, 2)], reward=1.0)


def test_stages_go_to_s3_and_kiln_export_reads_them_back(s3_server, tmp_path, monkeypatch,
                                                          capsys) -> None:
    import fsspec

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("results")
    job = RLJob.model_validate(yaml.safe_load(_job_text(output={"uri": "s3://results/run-1"})))
    sft = _export(tmp_path / "sft", {"config.json": '{"stage": "sft"}', "extra.txt": "sft only"})
    rl = _export(tmp_path / "rl", {"config.json": '{"stage": "rl"}', "model.safetensors": "w",
                                   **_tokenizer()})
    write_stage_output("s3://results/run-1", job, "sft", sft, {"steps": 4, "policy_version": 1})
    report = _export(tmp_path / "report", {"loss.png": "png", "reward.png": "png"})
    # The trainer's sample log: a trajectory logged twice (its batch served again after a
    # restart) goes to the output once.
    line = json.dumps({"stage": "rl", **_trajectory().to_dict()}) + "\n"
    trainer = _export(tmp_path / "trainer", {"trajectories.jsonl": line + line + '{"cut'})
    write_stage_output("s3://results/run-1", job, "rl", rl, {"steps": 2, "policy_version": 3},
                       report=report, samples=trainer)
    fs.invalidate_cache()
    assert sorted(k.rsplit("/", 1)[1] for k in fs.find("results/run-1/report")) == [
        "loss.png", "reward.png"]
    summary = json.loads(fs.cat_file("results/run-1/summary.json"))
    assert summary["final_stage"] == "rl" and set(summary["stages"]) == {"sft", "rl"}
    assert yaml.safe_load(fs.cat_file("results/run-1/job.yaml"))["metadata"]["name"] == "j"
    # final-hf is the rl stage's, without what the sft export had besides.
    assert sorted(k.rsplit("/", 1)[1] for k in fs.find("results/run-1/final-hf")) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert fs.cat_file("results/run-1/trajectories.jsonl").decode() == line
    # The job's TensorBoard files, the trainer's and the driver's, copied as they are.
    board = _export(tmp_path / "tensorboard", {"events.out.tfevents.1": "t",
                                                "driver/events.out.tfevents.2": "d"})
    write_tensorboard("s3://results/run-1", board)
    fs.invalidate_cache()
    assert fs.cat_file("results/run-1/tensorboard/driver/events.out.tfevents.2") == b"d"
    assert fs.cat_file("results/run-1/tensorboard/events.out.tfevents.1") == b"t"
    # `kiln trajectories` reads them from there, decoded with the exported tokenizer.
    capsys.readouterr()
    assert main(["trajectories", "s3://results/run-1"]) == 0
    shown = capsys.readouterr().out
    assert "=== traj-1  stage rl  task add-1" in shown and "action: hello world" in shown
    assert main(["trajectories", "s3://results/run-1", "--evaluations"]) == 1
    assert "evaluation episodes stay in the rollout pods" in capsys.readouterr().err

    assert main(["export", "s3://results/run-1", "--out", str(tmp_path / "final")]) == 0
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "final" / "config.json").read_text() == '{"stage": "rl"}'
    assert main(["export", "s3://results/run-1", "--stage", "sft", "--out",
                 str(tmp_path / "sft-out")]) == 0
    assert (tmp_path / "sft-out" / "extra.txt").read_text() == "sft only"
    capsys.readouterr()
    assert main(["export", "s3://results/run-1", "--stage", "eval", "--out",
                 str(tmp_path / "x")]) == 1
    assert "finished stages there: rl, sft" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
