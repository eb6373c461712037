"""Shared pytest options and markers.

`gpu` tests are skipped where torch sees no CUDA device; `k8s` tests run only with
`--kube-config PATH` naming a kubeconfig whose current context was made for tests.
"""
from __future__ import annotations

import os
import shutil

import pytest

# Without a GPU, Triton kernels run under Triton's interpreter, which must be chosen before
# triton is first imported -- by anything: vLLM imports triton too, and its tests may run first.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("KILN_TRITON_INTERPRET", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests that start one service by itself, with no certificate folder, let it serve plain text.
# `kiln run`, the operator's pods and the mutual-TLS tests give every service a certificate,
# which wins over this.
os.environ.setdefault("KILN_INSECURE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kube-config",
        default=None,
        help="kubeconfig of a throw-away test cluster (kind); enables tests marked k8s",
    )


def _cuda_available() -> bool:
    try:
        import torch
    except ModuleNotFoundError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kube = config.getoption("--kube-config")
    has_gpu = None
    for item in items:
        if "k8s" in item.keywords and not kube:
            item.add_marker(pytest.mark.skip(reason="needs --kube-config of a test cluster"))
        if "gpu" in item.keywords:
            if has_gpu is None:
                has_gpu = _cuda_available()
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def pytest_collection_finish(session: pytest.Session) -> None:
    # The keepalive test only waits (80 s of idle connections): start them now, read them then.
    from helpers import keepalive_probe

    if any(item.nodeid.endswith(keepalive_probe.TEST) for item in session.items):
        keepalive_probe.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from helpers import keepalive_probe

    keepalive_probe.stop()
