"""Interactive chat with streaming output.

A read-eval-print loop over one conversation: line editing and a persistent history through
`readline` (when the terminal has one), `/` commands that never reach the model, and a conversation
that keeps going when it outgrows the context: the oldest turns are dropped (a system message is
kept) and a dim line says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tilellm.commands.common import (
    ModelNotFound,
    add_engine_arguments,
    add_sampling_arguments,
    engine_kwargs,
    flag_error,
    resolve_model,
    sampling_kwargs,
)

COMMANDS = {
    "/help": "show this help",
    "/reset": "clear the conversation (asks y/N first)",
    "/exit": "quit (also /quit, Ctrl-D, or Ctrl-C at the prompt)",
}
_ALIASES = {"/quit": "/exit"}
_HELP = "Type a message and press Enter. " + ", ".join(COMMANDS) + "; /help explains them."
HISTORY_LENGTH = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--system", default=None, help="system message (kept when old turns are dropped)")
    add_sampling_arguments(parser, max_tokens=256)


# --- line editing and history --------------------------------------------------------------------


def history_path() -> Path:
    """Where the input history lives: $XDG_CACHE_HOME/tilellm/chat_history, else ~/.cache/tilellm/."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tilellm" / "chat_history"


def load_history(path: Path):
    """Import `readline` (line editing for `input()`) and read `path` into it; None where the
    platform has no readline. A missing or unreadable history file is not an error."""
    try:
        import readline
    except ImportError:
        return None
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(str(path))
    except OSError:
        pass
    return readline


def save_history(readline, path: Path) -> bool:
    """Write the history to `path`; False (and nothing said) where it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(str(path))
    except OSError:
        return False
    return True


# --- the conversation ----------------------------------------------------------------------------


def reply_room(max_tokens: int | None, max_model_len: int) -> int:
    """Tokens kept free for the answer: --max-tokens, but at most a quarter of the context, so a
    long --max-tokens still leaves room for the conversation."""
    quarter = max(1, max_model_len // 4)
    return quarter if max_tokens is None else max(1, min(max_tokens, quarter))


def fit_to_context(
    messages: list[dict], render: Callable[[list[dict]], list[int]], budget: int
) -> tuple[list[dict], list[int], int] | None:
    """Drop the oldest turns (a user message and the replies after it; leading system messages stay)
    until the rendered prompt has at most `budget` tokens.

    Returns (messages kept, their prompt ids, turns dropped), or None when even the last turn alone
    is too long."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    system, turns = messages[:head], messages[head:]
    dropped = 0
    while True:
        kept = system + turns
        ids = render(kept)
        if len(ids) <= budget:
            return kept, ids, dropped
        starts = [i for i, m in enumerate(turns) if m["role"] == "user"]
        if len(starts) < 2:
            return None
        turns = turns[starts[1] :]
        dropped += 1


def renderer(tokenizer) -> Callable[[list[dict]], list[int]]:
    """Prompt ids of a conversation: the chat template, or the plain concatenated text for a model
    that has none (a base language model continues the text)."""
    if getattr(tokenizer, "chat_template", None):

        def render(messages: list[dict]) -> list[int]:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template already holds any BOS: do not let encode() add another.
            return tokenizer.encode(text, add_special_tokens=False)

        return render
    return lambda messages: tokenizer.encode("".join(m["content"] for m in messages))


def stream_reply(engine, request_id: str, prompt_ids: list[int], params, out: TextIO | None = None) -> str:
    """Run one request on `engine`, writing its text to `out` (stdout) as it grows; returns the full
    reply."""
    out = out if out is not None else sys.stdout
    engine.add_request(request_id, prompt_ids, params)
    shown = 0
    text = ""
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                text = o.outputs[0].text
                # Hold back a trailing replacement char: the next token may complete it.
                visible = len(text) if o.finished else len(text.rstrip("\ufffd"))
                if visible > shown:
                    out.write(text[shown:visible])
                    out.flush()
                    shown = visible
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        out.write(" [interrupted]")
    out.write("\n")
    out.flush()
    return text


# --- the loop ------------------------------------------------------------------------------------


def _dim(text: str, out: TextIO) -> str:
    return f"\x1b[2m{text}\x1b[0m" if out.isatty() else text


def _help_text() -> str:
    return "\n".join(f"  {name:<7} {what}" for name, what in COMMANDS.items())


def _confirm(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return False


class ChatSession:
    """One conversation with `engine`: reads lines, runs commands, sends the rest to the model."""

    def __init__(self, engine, params, system: str | None, out: TextIO | None = None):
        self.engine = engine
        self.params = params
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = list(self.system)
        self.render = renderer(engine.tokenizer)
        self.budget = engine.max_model_len - reply_room(params.max_tokens, engine.max_model_len)
        self.out = out if out is not None else sys.stdout
        self.turn = 0

    def run(self) -> int:
        """Read until /exit, EOF or Ctrl-C at the prompt; returns the exit status (0)."""
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line) == "/exit":
                    return 0
                continue
            self.ask(line)

    def command(self, line: str) -> str | None:
        """Run a `/` command; returns its canonical name, None for an unknown one."""
        name = line.split()[0].lower()
        name = _ALIASES.get(name, name)
        if name == "/help":
            print(_help_text(), file=self.out)
        elif name == "/reset":
            if _confirm("Clear the conversation? [y/N] "):
                self.messages = list(self.system)
                print(_dim("(conversation cleared)", self.out), file=self.out)
            else:
                print(_dim("(kept)", self.out), file=self.out)
        elif name != "/exit":
            print(f"unknown command {name}; commands: {' '.join(COMMANDS)}", file=sys.stderr)
            return None
        return name

    def ask(self, text: str) -> None:
        """Send `text` as the next user turn and stream the reply."""
        fitted = fit_to_context([*self.messages, {"role": "user", "content": text}], self.render, self.budget)
        if fitted is None:
            print(
                f"message too long for the context ({self.engine.max_model_len} tokens, "
                f"{self.engine.max_model_len - self.budget} kept for the reply); shorten it",
                file=sys.stderr,
            )
            return
        self.messages, ids, dropped = fitted
        if dropped:
            kept = sum(m["role"] == "user" for m in self.messages)
            note = f"(context full: dropped the {dropped} oldest turn{'s' * (dropped > 1)}, {kept} kept)"
            print(_dim(note, self.out), file=self.out)
        reply = stream_reply(self.engine, f"chat-{self.turn}", ids, self.params, out=self.out)
        self.turn += 1
        self.messages.append({"role": "assistant", "content": reply})


def main(args: argparse.Namespace) -> int:
    try:
        model = resolve_model(args.model, "chat")
    except ModelNotFound as e:
        print(e, file=sys.stderr)
        return 2
    from tilellm import SamplingParams
    from tilellm.engine.llm_engine import LLMEngine

    try:
        params = SamplingParams(**{**sampling_kwargs(args), "n": 1})
    except ValueError as e:
        print(f"tilellm chat: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(model, **engine_kwargs(args))
    except ValueError as e:  # the engine's documented error for a model it cannot run
        raise flag_error(e) from None
    session = ChatSession(engine, params, args.system)
    # Line editing only at a terminal: piped input needs none, and some readline builds write
    # escape codes to stdout as soon as they are imported.
    readline = load_history(history_path()) if sys.stdin.isatty() else None
    print(_HELP, file=sys.stderr)
    try:
        return session.run()
    finally:
        if readline is not None:
            save_history(readline, history_path())
