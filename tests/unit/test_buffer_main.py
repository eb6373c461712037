"""Where the buffer process takes its settings from: the job's RL stage, then flags."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.api.validate import load_job
from kiln.services.buffer.main import build_parser, config_from

QUICKSTART = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "quickstart.yaml"


def _config(*argv: str, job: bool = True):
    return config_from(load_job(QUICKSTART) if job else None, build_parser().parse_args(list(argv)))


def test_job_rl_stage_gives_group_size_and_tau() -> None:
    c = _config()
    assert (c.capacity, c.group_size, c.tau) == (4096, 8, 2)


def test_sft_stage_has_groups_of_one_and_no_tau() -> None:
    c = _config("--stage", "sft")
    assert (c.group_size, c.tau) == (1, None)


def test_flags_override_the_job() -> None:
    c = _config("--capacity", "10", "--group-size", "4", "--tau", "none")
    assert (c.capacity, c.group_size, c.tau) == (10, 4, None)
    c = _config("--tau", "0", job=False)
    assert (c.capacity, c.group_size, c.tau, c.lease_timeout) == (4096, 1, 0, 300.0)
    assert _config("--lease-timeout", "2.5").lease_timeout == 2.5
    with pytest.raises(ValueError, match="lease_timeout"):
        _config("--lease-timeout", "0")


@pytest.mark.parametrize("value", ["-1", "four"])
def test_a_bad_tau_is_refused_with_what_is_expected(value, capsys) -> None:
    with pytest.raises(SystemExit):
        _config("--tau", value)
    err = capsys.readouterr().err
    assert "--tau" in err and "or 'none'" in err, err


def test_unknown_stage_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'.*stages: \\['sft', 'rl'\\]"):
        _config("--stage", "nope")
    with pytest.raises(ValueError, match="--stage needs --job"):
        _config("--stage", "rl", job=False)
