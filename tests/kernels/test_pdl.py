"""Which launches take part in programmatic dependent launch (`pdl.pdl_enabled`): every one of
the decode path's with `TILELLM_PDL=1`, none with `TILELLM_PDL=0`, and unset those of at most
`DEFAULT_PDL_ROWS` rows; never off a CUDA device of compute capability 9.0 or newer. The device's
capability is stubbed, so the rule runs on any machine."""

from __future__ import annotations

import pytest
import torch

from tilellm.kernels import pdl

HOPPER = torch.device("cuda", 0)


@pytest.fixture
def capable(monkeypatch):
    """A device 0 that can launch with PDL, whatever this machine has."""
    monkeypatch.setattr(pdl, "_pdl_capable", lambda index: True)
    monkeypatch.delenv("TILELLM_PDL_ROWS", raising=False)
    pdl._pdl_enabled.cache_clear()
    pdl._rows_bound.cache_clear()
    yield monkeypatch
    pdl._pdl_enabled.cache_clear()
    pdl._rows_bound.cache_clear()


def _set(monkeypatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("TILELLM_PDL", raising=False)
    else:
        monkeypatch.setenv("TILELLM_PDL", value)
    pdl._pdl_enabled.cache_clear()


@pytest.mark.parametrize("default_rows", [0, 1, 4])
def test_unset_takes_launches_of_at_most_the_default_rows(capable, default_rows):
    capable.setattr(pdl, "DEFAULT_PDL_ROWS", default_rows)
    _set(capable, None)
    for rows in range(1, 9):
        assert pdl.pdl_enabled(HOPPER, rows) == (rows <= default_rows)
        assert pdl.pdl_launch_kwargs(HOPPER, rows) == {
            "USE_PDL": rows <= default_rows,
            "launch_pdl": rows <= default_rows,
        }
    assert not pdl.pdl_enabled(HOPPER)  # a launch that does not say its rows: only when forced
    assert not pdl.pdl_enabled(HOPPER, 0)  # (nothing to launch)


def test_one_forces_every_launch_and_zero_none(capable):
    capable.setattr(pdl, "DEFAULT_PDL_ROWS", 1)
    _set(capable, "1")
    assert pdl.pdl_enabled(HOPPER) and pdl.pdl_enabled(HOPPER, 1) and pdl.pdl_enabled(HOPPER, 4096)
    _set(capable, "0")
    assert not pdl.pdl_enabled(HOPPER) and not pdl.pdl_enabled(HOPPER, 1)
    _set(capable, "yes")  # any other value: as unset
    assert pdl.pdl_enabled(HOPPER, 1) and not pdl.pdl_enabled(HOPPER, 2)


@pytest.mark.parametrize("bound", [0, 8, 256])
def test_pdl_rows_moves_the_bound_of_unset(capable, bound):
    """TILELLM_PDL_ROWS=N: launches of 1 to N rows take part where TILELLM_PDL is unset; "0"
    turns them all off; TILELLM_PDL=1 and =0 still decide alone."""
    capable.setattr(pdl, "DEFAULT_PDL_ROWS", 1)
    capable.setenv("TILELLM_PDL_ROWS", str(bound))
    pdl._rows_bound.cache_clear()
    _set(capable, None)
    for rows in (1, 2, 8, 9, 256, 257):
        assert pdl.pdl_enabled(HOPPER, rows) == (rows <= bound)
    assert not pdl.pdl_enabled(HOPPER) and not pdl.pdl_enabled(HOPPER, 0)
    _set(capable, "0")
    assert not pdl.pdl_enabled(HOPPER, 1)
    _set(capable, "1")
    assert pdl.pdl_enabled(HOPPER, 4096)


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_pdl_rows_says_what_it_takes(capable, value):
    capable.setenv("TILELLM_PDL_ROWS", value)
    pdl._rows_bound.cache_clear()
    _set(capable, None)
    with pytest.raises(ValueError, match="TILELLM_PDL_ROWS=.*row count >= 0"):
        pdl.pdl_enabled(HOPPER, 1)


def test_never_off_a_capable_cuda_device(monkeypatch):
    monkeypatch.setattr(pdl, "DEFAULT_PDL_ROWS", 8)
    _set(monkeypatch, "1")
    assert not pdl.pdl_enabled(torch.device("cpu"), 1)
    monkeypatch.setattr(pdl, "_pdl_capable", lambda index: False)  # pre-Hopper, or the interpreter
    pdl._pdl_enabled.cache_clear()
    assert not pdl.pdl_enabled(HOPPER, 1) and not pdl.pdl_enabled(HOPPER)
    pdl._pdl_enabled.cache_clear()
