"""`tilellm chat` driven through scripted stdin on the embedded model: many turns, /commands, exits."""

from __future__ import annotations

import builtins
import io
import re

import pytest

from tilellm.assets import demo_metadata
from tilellm.cli import main
from tilellm.commands import chat
from tilellm.demo.task import problems_for_model
from tilellm.engine.llm_engine import LLMEngine

ENGINE_FLAGS = ["--device", "cpu", "--attention-backend", "reference", "--num-kv-blocks", "64"]


@pytest.fixture
def prompts(monkeypatch) -> list[list[int]]:
    """Every prompt the engine is asked to run (the model sees nothing else)."""
    seen: list[list[int]] = []
    add = LLMEngine.add_request

    def recording(self, request_id, prompt, params=None, *a, **kw):
        seen.append(list(prompt))
        return add(self, request_id, prompt, params, *a, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    return seen


def _chat(monkeypatch, lines: list[str], *flags: str) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    return main(["chat", *ENGINE_FLAGS, *flags])


def _replies(stdout: str) -> list[str]:
    """The model's answers: the lines left once prompts and notices are taken out."""
    lines = [line.replace("> ", "") for line in stdout.splitlines()]
    return [line for line in lines if line and not line.startswith(("(", " "))]


def test_fifty_turns_stay_answered_and_old_turns_are_dropped(monkeypatch, capsys, prompts):
    problems = problems_for_model(demo_metadata(), 50, seed=11)
    assert _chat(monkeypatch, [p.question for p in problems] + ["/exit"]) == 0
    out = capsys.readouterr().out
    replies = _replies(out)
    assert len(replies) == 50 and len(prompts) == 50
    correct = sum(p.is_correct(r) for p, r in zip(problems, replies))
    assert correct >= 48, list(zip([p.question for p in problems], replies))
    notices = re.findall(r"\(context full: dropped the \d+ oldest turns?, \d+ kept\)", out)
    assert len(notices) >= 40  # from the fifth turn or so on, every turn drops one
    assert "\x1b[" not in out  # not a terminal: no ANSI codes
    room = chat.reply_room(256, 128)
    assert max(len(p) for p in prompts) <= 128 - room
    assert max(len(p) for p in prompts[10:]) > 128 - room - 20  # the context is kept nearly full


def test_commands_never_reach_the_model(monkeypatch, capsys, prompts):
    from transformers import AutoTokenizer

    from tilellm.assets import default_model_path

    lines = ["/help", "/frobnicate 1+1", "1111+2222", "/reset", "n", "3333+4444", "/RESET", "y", "5555+1111"]
    assert _chat(monkeypatch, [*lines, "/quit"]) == 0
    out, err = capsys.readouterr()
    for name in chat.COMMANDS:
        assert name in out  # /help lists every command
    assert "unknown command /frobnicate; commands: /help /reset /exit" in err
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    texts = [tok.decode(p) for p in prompts]
    assert len(texts) == 3 and not any("/" in t for t in texts)
    assert "1111+2222" in texts[1]  # /reset answered "n": the conversation goes on
    assert "1111+2222" not in texts[2] and "3333+4444" not in texts[2]  # "y": cleared
    assert "(conversation cleared)" in out and "(kept)" in out


def test_too_long_message_is_refused_and_the_chat_goes_on(monkeypatch, capsys, prompts):
    assert _chat(monkeypatch, ["9" * 200, "1234+5678"]) == 0  # EOF ends it
    _, err = capsys.readouterr()
    assert "message too long for the context" in err and "shorten it" in err
    assert len(prompts) == 1


@pytest.mark.parametrize("stop", [EOFError, KeyboardInterrupt])
def test_eof_and_ctrl_c_at_the_prompt_exit_cleanly(monkeypatch, capsys, stop):
    def interrupted(prompt=""):
        raise stop

    monkeypatch.setattr(builtins, "input", interrupted)
    assert main(["chat", *ENGINE_FLAGS]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_bad_sampling_flag_is_a_short_error(monkeypatch, capsys):
    assert _chat(monkeypatch, [], "--temperature", "-1") == 2
    err = capsys.readouterr().err
    assert err.startswith("tilellm chat:") and "Traceback" not in err


def _render(messages):
    return [0] * sum(1 + len(m["content"]) for m in messages)


def test_fit_to_context_drops_oldest_turns_and_keeps_the_system_message():
    conv = [{"role": "system", "content": "sys"}]
    for q in ("aaaa", "bbbb", "cccc"):
        conv += [{"role": "user", "content": q}, {"role": "assistant", "content": q.upper()}]
    conv.append({"role": "user", "content": "dddd"})
    kept, ids, dropped = chat.fit_to_context(conv, _render, budget=len(_render(conv)))
    assert (kept, dropped) == (conv, 0)
    kept, ids, dropped = chat.fit_to_context(conv, _render, budget=len(_render(conv)) - 1)
    assert dropped == 1 and kept == conv[:1] + conv[3:] and len(ids) <= len(_render(conv)) - 1
    kept, _, dropped = chat.fit_to_context(conv, _render, budget=4 + 5)
    assert dropped == 3 and kept == [conv[0], conv[-1]]
    assert chat.fit_to_context(conv, _render, budget=8) is None  # the last message alone does not fit


def test_reply_room_is_capped_by_the_context():
    assert chat.reply_room(8, 128) == 8
    assert chat.reply_room(256, 128) == 32
    assert chat.reply_room(None, 4096) == 1024


def test_history_file_lives_in_the_cache_and_write_failures_are_quiet(monkeypatch, tmp_path):
    import readline

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = chat.history_path()
    assert path == tmp_path / "tilellm" / "chat_history"
    assert chat.load_history(path) is readline  # no file yet: not an error
    readline.add_history("1234+5678")
    assert chat.save_history(readline, path) and path.is_file()
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert chat.save_history(readline, blocked / "sub" / "chat_history") is False
