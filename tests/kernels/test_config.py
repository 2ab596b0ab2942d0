"""`tilellm.kernels.config`: the Gluon gate (a Triton whose Gluon lacks what `hopper.py` needs
never breaks the package; the dispatch falls back to the portable Triton kernels, saying why
once), and the host's launch arithmetic against Triton's own."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from triton.compiler.errors import CompilationError

from tilellm.kernels import config

# A child interpreter in which `triton.experimental.gluon` cannot be imported, as on a Triton
# release without Gluon (or whose Gluon moved a name `hopper.py` imports).
_WITHOUT_GLUON = """
import sys, importlib.abc

class NoGluon(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("triton.experimental.gluon"):
            raise ImportError("no Gluon in this Triton")
        return None

sys.meta_path.insert(0, NoGluon())
import tilellm.kernels as tk
from tilellm.kernels import config
config.hopper = lambda device_index=None: True  # as on an H100/H200
config.interpreting = lambda: False
reason = config.gluon_unavailable()
assert reason is not None and "no Gluon" in reason, reason
assert not config.gluon_ok()
assert config.prefill_config(128, __import__("torch").bfloat16, 32768).kernel == "triton"
assert not config.paged_uses_gluon(128, __import__("torch").bfloat16, 16, 512, 1 << 20)
print("fallback ok", tk.prefill_attention.__name__)
"""


def test_import_works_without_gluon_and_dispatch_falls_back():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_GLUON], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fallback ok prefill_attention" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "Gluon kernels unavailable" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]


@pytest.fixture
def fresh_gate(monkeypatch):
    """The gate with no recorded verdict, restored afterwards."""
    monkeypatch.setattr(config, "_gluon_disabled", None)
    yield
    config._gluon_disabled = None


def test_a_build_failure_disables_the_gluon_kernels_once(fresh_gate, monkeypatch, caplog):
    monkeypatch.setattr(config, "hopper", lambda device_index=None: True)
    monkeypatch.setattr(config, "interpreting", lambda: False)  # the tile tables of a real GPU
    assert config.gluon_unavailable() is None  # the installed Triton imports hopper.py
    assert config.prefill_config(128, torch.bfloat16, 32768).kernel == "gluon"
    calls = []

    def failing_launch(hopper):
        calls.append(hopper.__name__)
        raise CompilationError("k.py", None, "AttributeError: module has no attribute 'thread_barrier'")

    with caplog.at_level(logging.WARNING, logger="tilellm.kernels.config"):
        assert config.launch_gluon(failing_launch) is False
        assert config.launch_gluon(failing_launch) is False  # not retried
    assert calls == ["tilellm.kernels.hopper"]
    assert len([r for r in caplog.records if "Gluon kernels unavailable" in r.getMessage()]) == 1
    assert "thread_barrier" in config.gluon_unavailable()
    assert config.prefill_config(128, torch.bfloat16, 32768).kernel == "triton"
    assert not config.paged_uses_gluon(128, torch.bfloat16, 16, 512, 1 << 20)


def test_launch_errors_other_than_a_build_failure_propagate(fresh_gate):
    def broken_launch(hopper):
        raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        config.launch_gluon(broken_launch)
    assert config.gluon_unavailable() is None  # a launch error is not a verdict on this Triton


def test_a_successful_launch_runs_once(fresh_gate):
    seen = []
    assert config.launch_gluon(lambda hopper: seen.append(hopper.QUERY_TILE)) is True
    assert seen == [config.GLUON_QUERY_TILE]


def test_launch_arithmetic_matches_triton():
    """`cdiv` and `next_power_of_2` give `triton.cdiv`'s and `triton.next_power_of_2`'s values."""
    import triton

    values = list(range(0, 4100)) + [2**k + d for k in range(12, 40) for d in (-1, 0, 1)]
    for n in values:
        assert config.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in values[:600] + values[-30:]:
        for b in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert config.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    import numpy as np

    for n in (0, 1, 5, 64, 1000):  # integer types that validated arguments may carry
        assert config.next_power_of_2(np.int64(n)) == triton.next_power_of_2(n)
        assert config.next_power_of_2(torch.tensor(n)) == triton.next_power_of_2(n)
        assert config.cdiv(np.int32(n), 16) == triton.cdiv(n, 16)
