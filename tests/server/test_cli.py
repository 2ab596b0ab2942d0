"""`tilellm serve` as a process (graceful SIGTERM/SIGINT, exit 0); `tilellm bench serve` against a server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, assert_error
from tilellm.server.launcher import bind_socket


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def _start_serve(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tilellm.cli", "serve", model_dir, "--port", str(port), "--device", "cpu"]
    cmd += ["--num-kv-blocks", "64", "--max-model-len", "256", "--uvicorn-log-level", "warning", *extra]
    env = {**os.environ, "TILELLM_API_KEY": "env-key"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not become healthy")


@pytest.mark.parametrize(
    "sig, grace, max_tokens, engine_flag",
    [
        # 200 tokens: the stream must outlast the second request's admission (a full response
        # costs the server nothing per step, so a short stream can finish before it)
        (signal.SIGTERM, "30", 200, "--engine-process"),
        (signal.SIGINT, "0.2", 240, "--engine-process"),
        (signal.SIGTERM, "30", 200, "--no-engine-process"),
    ],
    ids=["sigterm-finishes-in-flight", "sigint-aborts-after-grace", "sigterm-engine-thread"],
)
def test_serve_shuts_down_gracefully_on_signal(tiny_model_dir, sig, grace, max_tokens, engine_flag):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_serve(
        tiny_model_dir,
        port,
        "--served-model-name",
        MODEL_NAME,
        "--graceful-shutdown-timeout",
        grace,
        engine_flag,
    )
    try:
        _wait_healthy(proc, url)
        headers = {"Authorization": "Bearer env-key"}  # the key came from $TILELLM_API_KEY
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        body = {
            "model": MODEL_NAME,
            "prompt": [4] * 10,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        plain: list[httpx.Response] = []  # a non-streamed request in flight beside the stream
        sender = threading.Thread(
            target=lambda: plain.append(
                httpx.post(
                    url + "/v1/completions", json={**body, "stream": False}, headers=headers, timeout=60
                )
            )
        )
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as resp:
            lines = resp.iter_lines()
            events.append(next(ln for ln in lines if ln.startswith("data: ")))
            sender.start()
            _wait_running(url, headers, 2)  # the plain request is in the engine too
            proc.send_signal(sig)  # mid-stream
            events += [ln for ln in lines if ln.startswith("data: ")]
        sender.join(60)
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert httpx_refused(url)
        assert events[-1] == "data: [DONE]"
        if sig == signal.SIGTERM:  # allowed to finish
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
            assert plain[0].status_code == 200
        else:  # failed, not cut off, once the grace period ran out; one line in the log
            assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
            assert assert_error(plain[0], 503)["code"] == "shutting_down"
            assert log.count("graceful shutdown period over: 2 requests") == 1, log
            assert "Traceback" not in log and "CancelledError" not in log, log
        # The engine process unfreezes its heap before exit: no nanobind "leaked" report.
        assert "leaked" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_exits_nonzero_when_its_engine_dies(tiny_model_dir):
    """kill -9 of the engine process: the request in flight gets a 503 engine_dead and `tilellm
    serve` exits with status 1, for a supervisor to restart it.

    The engine is frozen (SIGSTOP) before the request is sent, so that the request is surely in
    flight when the engine dies (a tiny model can finish 240 tokens before a fixed sleep ends)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_serve(tiny_model_dir, port, "--served-model-name", MODEL_NAME)
    try:
        _wait_healthy(proc, url)
        engine_pid = next(p for p in _children(proc.pid) if "spawn_main" in _cmdline(p))
        headers = {"Authorization": "Bearer env-key"}
        body = {"model": MODEL_NAME, "prompt": [4] * 10, "max_tokens": 240, "ignore_eos": True}
        got: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: got.append(
                httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            )
        )
        os.kill(engine_pid, signal.SIGSTOP)
        sender.start()
        time.sleep(1.0)
        assert not got  # waiting on the frozen engine
        os.kill(engine_pid, signal.SIGKILL)
        sender.join(60)
        assert proc.wait(timeout=60) == 1
        assert assert_error(got[0], 503)["code"] == "engine_dead"
        assert "exit status 1" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_running(url: str, headers: dict, count: int, timeout: float = 30) -> None:
    """Until the server's engine runs `count` requests (its `num_requests_running` gauge): a fixed
    sleep lets a loaded machine signal the server before the request has even connected."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
        gauge = "tilellm:num_requests_running{"
        running = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(gauge))
        if running >= count:
            return
        assert time.monotonic() < deadline, f"{running:.0f} of {count} requests running after {timeout} s"
        time.sleep(0.02)


def httpx_refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_bench_serve_against_the_server(server, tmp_path):
    from tests.server.conftest import API_KEY
    from tilellm.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6"]
    argv += ["--input-len", "12", "--output-len", "5", "--token-id-max", "300", "--max-concurrency", "3"]
    argv += ["--request-rate", "100", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 72
    for key in (
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p99_itl_ms",
        "output_throughput",
    ):
        assert result[key] is not None and result[key] >= 0


def test_bench_serve_with_several_client_processes(server, tmp_path):
    """--num-clients 3: every request is sent once, by one of three processes, and the summary
    counts them all (7 requests: the processes get 3, 2 and 2). With --max-concurrency 2 only
    two clients run (one request in flight each)."""
    from tests.server.conftest import API_KEY
    from tilellm.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "7"]
    argv += ["--input-len", "9", "--output-len", "4", "--token-id-max", "300", "--num-clients", "3"]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_clients"] == 3
    assert result["completed"] == 7 and result["failed"] == 0
    assert result["total_output_tokens"] == 28 and result["total_input_tokens"] == 63
    assert result["duration_s"] > 0 and result["p50_ttft_ms"] >= 0
    argv += ["--max-concurrency", "2"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_clients"] == 2 and result["completed"] == 7 and result["failed"] == 0


def test_serve_help_lists_the_flags(capsys):
    from tilellm.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flags = ["--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs"]
    flags += [
        "--gpu-memory-utilization",
        "--block-size",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
    ]
    flags += ["--max-waiting", "--max-request-bytes", "--device", "--num-kv-blocks"]
    flags += ["--engine-process", "--no-engine-process", "--tensor-parallel-size", "--stream-interval"]
    assert all(f in out for f in flags), [f for f in flags if f not in out]


def test_serve_without_model_uses_the_embedded_one(capsys):
    from tilellm.assets import default_model_path
    from tilellm.commands.serve import _resolve_model

    path, name = _resolve_model(None)
    assert path == str(default_model_path()) and name == default_model_path().name
    assert "embedded default model" in capsys.readouterr().err


def test_serve_rejects_a_directory_without_a_model(tmp_path, capsys):
    from tilellm.cli import main

    assert main(["serve", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_engine_process_goes_when_serve_is_killed_during_start(tiny_model_dir):
    """SIGTERM before the server is up kills `tilellm serve` at once (no handler yet); its engine
    process, which ignores signals, must notice and exit by itself."""
    proc = _start_serve(tiny_model_dir, _free_port())
    children: list[int] = []
    deadline = time.monotonic() + 60
    while not children and time.monotonic() < deadline and proc.poll() is None:
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
        children = [
            int(p) for p in out.split() if "spawn_main" in _cmdline(int(p))
        ]  # not the resource tracker
        time.sleep(0.05)
    assert children, "no engine process was started"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "the engine process outlived `tilellm serve`"
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its new parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
