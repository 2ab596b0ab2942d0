"""Interactive chat with streaming output."""

from __future__ import annotations

import argparse
import itertools
import sys

from tilellm.commands.common import (
    ModelNotFound,
    add_engine_arguments,
    add_sampling_arguments,
    engine_kwargs,
    resolve_model,
    sampling_kwargs,
)

_HELP = "Type a message and press Enter. /reset clears the conversation, /exit (or Ctrl-D) quits."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(parser, max_tokens=256)


def stream_reply(engine, request_id: str, prompt_ids: list[int], params, out=sys.stdout) -> str:
    """Run one request on `engine`, writing its text as it grows; returns the full reply."""
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
    engine = LLMEngine(model, **engine_kwargs(args))
    tok = engine.tokenizer
    has_template = bool(getattr(tok, "chat_template", None))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    print(_HELP, file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(system)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        if has_template:
            text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
        else:  # a plain language model: continue the raw text
            ids = tok.encode("".join(m["content"] for m in history))
        if len(ids) >= engine.max_model_len:
            print(
                f"(conversation too long: {len(ids)} tokens >= {engine.max_model_len}; /reset)",
                file=sys.stderr,
            )
            history.pop()
            continue
        reply = stream_reply(engine, f"chat-{turn}", ids, params)
        history.append({"role": "assistant", "content": reply})
    return 0
