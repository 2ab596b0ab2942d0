"""A new user's mistakes on the `tilellm` command line: one or two lines on stderr naming the
problem and the fix, exit 2, no traceback; a bug still raises."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tilellm.assets import default_model_path
from tilellm.cli import main
from tilellm.commands import common

# Every command that takes a model, with the flags that make it need one.
MODEL_COMMANDS = [
    ["generate", "-p", "1+2="],
    ["chat"],
    ["demo"],
    ["inspect", "--demo"],
    ["serve"],
    ["bench", "throughput", "--scale", "0.02"],
]
DEVICE_COMMANDS = [*MODEL_COMMANDS]


def _short_error(capsys, *must_contain: str) -> str:
    """stderr: no traceback, at most two lines besides the embedded model's announcement."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "no --model given, using" not in ln]
    assert "Traceback" not in err and 1 <= len(lines) <= 2, err
    for text in must_contain:
        assert text in err, err
    return err


def _model_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    return {
        "missing": (str(tmp_path / "does-not-exist"), "no such directory"),
        "file": (str(a_file), "is a file, not a model directory"),
        "empty": (str(empty), "no config.json"),
        "hub id": ("Qwen/Qwen3-0.6B", "huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR"),
    }


@pytest.mark.parametrize("kind", ["missing", "file", "empty", "hub id"])
@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_bad_model_directory_is_one_line_and_exit_2(command, kind, tmp_path, capsys):
    model, why = _model_dirs(tmp_path)[kind]
    assert main([*command, "--model", model, "--device", "cpu"]) == 2
    _short_error(capsys, f"--model {model}", why)


def test_hub_id_says_how_to_get_a_local_directory(capsys):
    assert main(["generate", "-p", "x", "--model", "Qwen/Qwen3-0.6B"]) == 2
    err = _short_error(capsys, "local model directories only", "then --model DIR")
    assert len(err.strip().splitlines()) == 2


def test_config_json_itself_points_at_its_directory(capsys):
    config = default_model_path() / "config.json"
    assert main(["generate", "-p", "x", "--model", str(config)]) == 2
    _short_error(capsys, f"did you mean --model {default_model_path()}?")


def test_a_directory_without_weights_or_tokenizer(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(default_model_path() / "config.json", model / "config.json")
    assert main(["generate", "-p", "x", "--model", str(model)]) == 2
    _short_error(capsys, "has no *.safetensors weights")
    # serve names the flag that lifts the need
    assert main(["serve", str(model), "--port", "0"]) == 2
    _short_error(capsys, "--load-format dummy")
    shutil.copy(default_model_path() / "model.safetensors", model / "model.safetensors")
    assert main(["serve", str(model), "--port", "0"]) == 2
    _short_error(capsys, "has no tokenizer", "--skip-tokenizer-init")


def _no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("command", DEVICE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_device_cuda_without_a_gpu(command, monkeypatch, capsys):
    _no_cuda(monkeypatch)
    assert main([*command, "--device", "cuda"]) == 2
    _short_error(capsys, "--device cuda", "--device cpu")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0"], ids=["word", "index", "cpu-index"])
def test_a_device_that_is_no_device(device, capsys):
    assert main(["generate", "-p", "x", "--device", device]) == 2
    _short_error(capsys, "--device must be cuda, cuda:N or cpu")


def test_missing_prompts_file(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    assert main(["generate", "--prompts-file", str(path)]) == 2
    _short_error(capsys, f"--prompts-file {path}", "No such file")
    path.write_bytes(b"\xff\xfe 1+2=\n")
    assert main(["generate", "--prompts-file", str(path)]) == 2
    _short_error(capsys, "not UTF-8 text")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "-5"], "--top-k must be"),
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1, got 0"),
        (["--n", "0"], "--n must be an integer in [1, 128]"),
        (["--block-size", "0"], "--block-size must be a positive integer"),
        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in (0, 1]"),
    ],
)
def test_flag_errors_name_the_flag_not_the_python_field(flags, message, capsys):
    assert main(["generate", "-p", "x", *flags]) == 2
    err = _short_error(capsys, message)
    assert "SamplingParams" not in err and "_" not in err.split("error:")[1].split(",")[0]


def test_sampling_params_keeps_its_name_and_names_the_seed_flag():
    args = argparse.Namespace(
        max_tokens=4, temperature=0.5, top_p=1.0, top_k=-1, min_p=2.0, sampling_seed=None, stop=None
    )
    args.ignore_eos, args.n = False, 1
    with pytest.raises(common.UsageError, match=r"^--min-p must be in \[0, 1\]"):
        common.sampling_params(args)
    assert common.sampling_params(args, min_p=0.1).min_p == 0.1


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only UsageError becomes a short message: any other exception propagates."""
    import tilellm.commands.generate as generate

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(generate, "main", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["generate", "-p", "x"])


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    import tilellm.commands.generate as generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "main", interrupted)
    assert main(["generate", "-p", "x"]) == 130
    assert capsys.readouterr().err == "tilellm generate: interrupted\n"


# -- one spelling of the model argument -----------------------------------------------------------


def _busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def test_serve_takes_the_model_positionally_or_as_a_flag(tmp_path, capsys):
    model = str(default_model_path())
    other = tmp_path / "other"
    shutil.copytree(default_model_path(), other)
    assert main(["serve", model, "--model", str(other)]) == 2
    _short_error(capsys, "two models given", "give one")
    with _busy_port() as busy:  # accepted spellings get as far as the port, which is taken
        port = str(busy.getsockname()[1])
        for argv in ([model], ["--model", model], [model, "--model", model + "/"]):
            assert main(["serve", *argv, "--port", port]) == 2
            err = _short_error(capsys, f"127.0.0.1:{port} is already in use", "--port N")
            assert "two models" not in err


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_takes_model_dir(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "--model DIR" in out, out
    if command[0] == "serve":
        assert "[MODEL]" in out


# -- the embedded model and the default device ----------------------------------------------------


def test_no_model_means_the_embedded_one_announced_on_stderr(capsys):
    assert common.resolve_model(None, "generate") == str(default_model_path())
    err = capsys.readouterr().err
    assert (
        err.strip()
        == f"tilellm generate: no --model given, using the embedded default model at {default_model_path()}"
    )


@pytest.mark.parametrize("cuda", [False, True])
def test_demo_device_defaults_to_cuda_when_available(cuda, monkeypatch):
    import torch

    import tilellm.demo

    seen = {}

    class Stop(Exception):
        pass

    def fake_run_demo(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(tilellm.demo, "run_demo", fake_run_demo)
    with pytest.raises(Stop):
        main(["demo", "--quiet"])
    assert seen["device"] == ("cuda" if cuda else "cpu")


# -- bench throughput on the CPU -------------------------------------------------------------------


def test_bench_throughput_on_cpu_names_the_short_run_before_any_work(monkeypatch, capsys):
    _no_cuda(monkeypatch)
    assert main(["bench", "throughput"]) == 2
    captured = capsys.readouterr()
    assert "building the engine" not in captured.out
    assert "GPU benchmark" in captured.err and "--scale 0.02 --workloads E1" in captured.err
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 2


def test_bench_kernels_without_a_gpu_says_so_on_stderr(monkeypatch, capsys):
    _no_cuda(monkeypatch)
    assert main(["bench", "kernels"]) == 2
    _short_error(capsys, "tilellm bench kernels: error:", "CUDA GPU")


# -- no nanobind teardown report after the real message -------------------------------------------


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, env=env
    )


# Importing triton and freezing the collector leaves libtriton objects alive at teardown, so that
# nanobind reports them: what a long-lived `tilellm serve` process does.
_LEAKY = "import gc, sys, triton; gc.collect(); gc.freeze()\n"


def test_teardown_report_is_silenced_but_the_error_shows():
    with _busy_port() as busy:
        port = str(busy.getsockname()[1])
        argv = ("serve", "--port", port, "--device", "cpu")
        control = _run(_LEAKY + "sys.exit(2)")
        assert "nanobind: leaked" in control.stderr  # without tilellm.cli.main: the report shows
        proc = _run(_LEAKY + "from tilellm.cli import main\nsys.exit(main())", *argv)
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port} is already in use" in proc.stderr
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr


def test_serve_on_a_busy_port_fails_at_once_with_one_line():
    with _busy_port() as busy:
        port = str(busy.getsockname()[1])
        proc = subprocess.run(
            [sys.executable, "-m", "tilellm.cli", "serve", "--port", port, "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert (
        lines[-1]
        == f"tilellm serve: error: 127.0.0.1:{port} is already in use (another server?); pass --port N"
    )
    assert "leaked" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
