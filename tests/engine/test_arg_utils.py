"""`EngineArgs`: the command line's engine flags are `EngineConfig`'s fields, defaults written once;
`LLM(...)` takes the same names and refuses others."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tilellm import LLM
from tilellm.config import EngineConfig
from tilellm.engine.arg_utils import EngineArgs


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, **kw)
    return p


def test_every_cli_setting_is_a_flag_with_the_configs_default():
    args = _parser().parse_args([])
    got = EngineArgs.from_cli_args(args)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    exposed = {n for n, f in fields.items() if f.metadata["cli"]}
    assert set(got) == exposed and {"dtype", "block_size", "max_num_batched_tokens", "seed"} <= exposed
    assert all(got[n] == fields[n].default for n in exposed)
    EngineConfig(model="m", **got)  # the defaults are a valid configuration


def test_flags_parse_to_the_engines_keywords():
    args = _parser().parse_args(
        ["--no-enable-prefix-caching", "-tp", "2", "--dtype", "bfloat16", "--max-model-len", "512"]
    )
    got = EngineArgs.from_cli_args(args)
    assert got["enable_prefix_caching"] is False and got["tensor_parallel_size"] == 2
    assert got["dtype"] == "bfloat16" and got["max_model_len"] == 512
    with pytest.raises(SystemExit):
        _parser().parse_args(["--dtype", "float8"])  # choices come from the config too


def test_a_commands_own_default_and_excluded_settings():
    p = _parser(defaults={"max_num_batched_tokens": 16384}, exclude=("max_model_len",))
    args = p.parse_args([])
    assert args.max_num_batched_tokens == 16384 and not hasattr(args, "max_model_len")
    (action,) = [a for a in p._actions if a.dest == "max_num_batched_tokens"]
    assert "this command's default: 16384; the engine's: 8192" in action.help


def test_llm_refuses_an_unknown_setting_by_name():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        LLM(max_num_seq=4)


def test_llm_without_a_model_uses_the_embedded_one(caplog):
    from tilellm.assets import default_model_path

    llm = LLM(device="cpu", max_num_seqs=4)
    assert llm.llm_engine.config.model == str(default_model_path())
    assert "embedded model" in caplog.text
