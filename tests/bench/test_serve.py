"""`tilellm bench serve` fits its workload to the served model: prompt ids inside the vocabulary,
lengths inside max_model_len; against the default `tilellm serve` it needs no extra flag."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys

import pytest

from tilellm.assets import default_model_path
from tilellm.bench.serve import add_arguments, fit_to_server, make_workload, vocab_size_of
from tilellm.commands.common import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _embedded_vocab() -> int:
    from transformers import AutoTokenizer

    config = json.loads((default_model_path() / "config.json").read_text())
    return min(config["vocab_size"], len(AutoTokenizer.from_pretrained(str(default_model_path()))))


def test_the_servers_vocabulary_size_wins():
    args = _args()
    fit_to_server(args, {"id": "m", "root": "/nowhere/m", "vocab_size": 300})
    assert args.vocab_size == 300 and args.token_id_max == 10000
    work = make_workload(8, 20, 4, args.token_id_max, 0, vocab_size=args.vocab_size)
    plain = make_workload(8, 20, 4, args.token_id_max, 0)
    assert work.prompts == [[t % 300 for t in p] for p in plain.prompts]
    assert max(max(p) for p in plain.prompts) >= 300  # the folding had something to do


def test_the_embedded_model_served_elsewhere_uses_its_tokenizer():
    args = _args()
    fit_to_server(args, {"id": "tiny-arith", "root": "/another/machine/tiny-arith"})
    assert args.vocab_size == _embedded_vocab() <= 128


def test_a_model_directory_on_this_machine_or_given(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 777}))
    args = _args()
    fit_to_server(args, {"id": "served-name", "root": str(model)})  # the server's own directory
    assert args.vocab_size == 777
    args = _args("--tokenizer", str(default_model_path()))
    fit_to_server(args, {"id": "served-name", "root": str(model)})
    assert args.vocab_size == _embedded_vocab()
    assert vocab_size_of(tmp_path) is None  # neither config.json nor a tokenizer


def test_an_unknown_vocabulary_leaves_e1s_ids():
    args = _args()
    fit_to_server(args, {"id": "remote", "root": "remote"})
    assert args.vocab_size is None and args.token_id_max == 10000


def test_an_explicit_token_id_max_outside_the_vocabulary_is_a_usage_error():
    with pytest.raises(UsageError, match="--token-id-max 500: the served model has 300 ids"):
        fit_to_server(_args("--token-id-max", "500"), {"id": "m", "vocab_size": 300})


def test_lengths_shrink_to_max_model_len():
    args = _args()
    fit_to_server(args, {"id": "m", "vocab_size": 300, "max_model_len": 128})
    work = make_workload(256, None, None, 10000, 0, scale=args.scale)
    assert max(len(p) + m for p, m in zip(work.prompts, work.max_tokens)) <= 128
    args = _args("--output-len", "20")
    fit_to_server(args, {"id": "m", "max_model_len": 128})
    work = make_workload(64, None, 20, 10000, 0, scale=args.scale)
    assert max(len(p) for p in work.prompts) + 20 <= 128
    with pytest.raises(UsageError, match="do not fit the served model's max_model_len 128"):
        fit_to_server(_args("--input-len", "100", "--output-len", "50"), {"id": "m", "max_model_len": 128})


def test_against_the_default_server_with_no_flags(tmp_path, capsys):
    """`tilellm serve` (the embedded model, CPU) in a subprocess; `tilellm bench serve` with only the
    URL: every request completes, its ids inside the 128-id vocabulary, lengths inside 128."""
    from tests.server.test_cli import _free_port, _wait_healthy
    from tilellm.cli import main

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tilellm.cli", "serve", "--port", str(port), "--device", "cpu"]
    cmd += ["--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, url)
        out = tmp_path / "bench.json"
        assert main(["bench", "serve", "--base-url", url, "--num-prompts", "6", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
        err = capsys.readouterr().err
        assert "modulo the served model's vocabulary" in err and "max_model_len is 128" in err
        assert main(["bench", "serve", "--base-url", url, "--model", "nope"]) == 2
        assert "the server serves tiny-arith" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tokenizer_must_name_a_directory(tmp_path):
    with pytest.raises(UsageError, match="--tokenizer .*: no such directory"):
        fit_to_server(_args("--tokenizer", str(tmp_path / "nope")), {"id": "m"})
