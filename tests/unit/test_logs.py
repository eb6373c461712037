"""Service logs: with KILN_LOG_FORMAT=json every line on stderr is one JSON object, Python
warnings, an uncaught exception and a library's own plain-text handler included; vLLM's
processes (which configure logging from the file the service hands them, as vLLM does with
`VLLM_LOGGING_CONFIG_PATH`: json.load and dictConfig) write JSON too; an unknown format or
level is refused naming its variable. Each case runs in a process of its own, as a service
does (logging is per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, os, sys, warnings
from kiln.logs import adopt_library_loggers, setup_logging

early = logging.getLogger("early_lib")          # a library configured before the service
early.addHandler(logging.StreamHandler(sys.stderr)); early.propagate = False
setup_logging("trainer")
late = logging.getLogger("late_lib")            # one that adds its handler while building
late.addHandler(logging.StreamHandler(sys.stderr)); late.propagate = False
adopt_library_loggers()
logging.getLogger("kiln.x").info("service line")
warnings.warn("Apex is not installed. Falling back to Torch Norm")
early.warning("early library line")
late.warning("late library line")
print(os.environ.get("VLLM_LOGGING_CONFIG_PATH", ""))
sys.stdout.flush()
if os.environ.get("CRASH"):
    raise RuntimeError("boom")
"""

# What vLLM does in each process that imports it (its engine core included) with the file.
ENGINE = """
import json, logging, logging.config, sys, warnings
logging.config.dictConfig(json.load(open(sys.argv[1])))
logging.getLogger("vllm.v1.engine.core").info("engine core line")
warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)

class Engine:
    def __del__(self):
        raise TypeError("'NoneType' object is not callable")

Engine()
"""


def _run(**env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **env}.items() if not k.startswith("VLLM_")}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, env=env)


def test_every_line_is_json_warnings_and_library_handlers_included() -> None:
    res = _run(KILN_LOG_FORMAT="json")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    records = [json.loads(line) for line in lines]  # fails on any plain-text line
    assert [r["msg"] for r in records][:1] == ["service line"]
    assert {r["logger"] for r in records} == {"kiln.x", "py.warnings", "early_lib", "late_lib"}
    warning = next(r for r in records if r["logger"] == "py.warnings")
    assert "UserWarning: Apex is not installed" in warning["msg"] and warning["level"] == "warning"
    assert all(r["service"] == "trainer" for r in records)


def test_an_uncaught_error_and_vllm_processes_log_json_too(tmp_path) -> None:
    res = _run(KILN_LOG_FORMAT="json", CRASH="1")
    assert res.returncode == 1
    records = [json.loads(line) for line in res.stderr.splitlines()]
    crash = records[-1]
    assert crash["logger"] == "kiln.uncaught" and "RuntimeError: boom" in crash["exc"]
    # The file a service hands vLLM (removed when the service exits: read while it lives).
    config = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, os; from kiln.logs import setup_logging;"
         "setup_logging('rollout'); print(open(os.environ['VLLM_LOGGING_CONFIG_PATH']).read())"],
        capture_output=True, text=True, timeout=60, check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}).stdout)
    path = tmp_path / "vllm-logging.json"
    path.write_text(json.dumps(config))
    engine = subprocess.run([sys.executable, "-c", ENGINE, str(path)], capture_output=True,
                            text=True, timeout=60)
    lines = engine.stderr.splitlines()
    records = [json.loads(line) for line in lines]  # fails on any plain-text line
    assert {r["logger"] for r in records} == {"vllm.v1.engine.core", "py.warnings", "kiln.uncaught"}
    assert all(r["service"] == "rollout" for r in records)


def test_text_format_stays_text() -> None:
    res = _run(KILN_LOG_FORMAT="text")
    assert res.returncode == 0, res.stderr
    assert "trainer INFO kiln.x: service line" in res.stderr
    assert not res.stderr.lstrip().startswith("{")


@pytest.mark.parametrize("env, named", [({"KILN_LOG_FORMAT": "yaml"}, "KILN_LOG_FORMAT: 'yaml'"),
                                        ({"KILN_LOG_LEVEL": "loud"}, "KILN_LOG_LEVEL: 'LOUD'")])
def test_unknown_format_or_level_is_refused_by_name(env: dict, named: str) -> None:
    res = _run(**env)
    assert res.returncode != 0 and named in res.stderr


RELAYED = r"""
import logging, os, subprocess, sys
from kiln.logs import setup_logging

setup_logging("rollout", relay=True)
logging.getLogger("kopf.objects").info("handled", extra={"k8s_ref": {"name": "job",
                                                                      "namespace": "team"}})
print("Triton is installed, but doesn't include CPU backend.")       # a library's bare print
sys.stdout.flush()
os.write(2, b"[W1207 19:05:09.33 utils.cpp:68] Warning: NUMA binding\n")  # C++, below Python
os.write(2, b"Loading shards:   0% | 0/1\rLoading shards: 100% | 1/1\n")  # a progress bar
# A child that inherited the pipe: its plain line is wrapped, its JSON record passed through.
subprocess.run([sys.executable, "-c", "import os; os.write(2, b'child plain\\n');"
                "os.write(2, b'{\"ts\": 1.0, \"level\": \"info\", \"msg\": \"child record\"}\\n')"])
os.write(2, b"last words, unterminated")
os._exit(3)                       # dies without flushing or tearing anything down
"""


def test_relay_turns_every_stray_line_into_json() -> None:
    """A service's stdout and stderr below Python's logging (C++ warnings, progress bars, bare
    prints, its children's output, what it writes as it dies) arrive as JSON records."""
    res = subprocess.run([sys.executable, "-c", RELAYED], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "KILN_LOG_FORMAT": "json"})
    assert res.returncode == 3
    assert res.stdout == ""
    records = [json.loads(line) for line in res.stderr.splitlines()]  # fails on plain text
    by_msg = {r["msg"]: r for r in records}
    assert by_msg["handled"]["object"] == "team/job"
    stray = {m: r for m, r in by_msg.items() if r.get("logger") == "stdout"}
    assert set(stray) == {"Triton is installed, but doesn't include CPU backend.",
                          "[W1207 19:05:09.33 utils.cpp:68] Warning: NUMA binding",
                          "Loading shards:   0% | 0/1", "Loading shards: 100% | 1/1",
                          "child plain", "last words, unterminated"}
    assert stray["[W1207 19:05:09.33 utils.cpp:68] Warning: NUMA binding"]["level"] == "warning"
    assert all(r["service"] == "rollout" for r in stray.values())
    assert by_msg["child record"] == {"ts": 1.0, "level": "info", "msg": "child record"}
