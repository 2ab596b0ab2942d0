"""Generate completions for prompts (offline, batched)."""

from __future__ import annotations

import argparse
import json
import sys

from tilellm.commands.common import (
    UsageError,
    add_engine_arguments,
    add_sampling_arguments,
    engine_kwargs,
    flag_error,
    resolve_model,
    sampling_params,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompt", "-p", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", default=None, help="one prompt per line ('-' = stdin)")
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message (chat template)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_sampling_arguments(parser)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
            with stream:
                prompts += [line.rstrip("\n") for line in stream if line.strip()]
        except OSError as e:
            raise UsageError(f"--prompts-file {args.prompts_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--prompts-file {args.prompts_file}: not UTF-8 text") from None
    return prompts


def main(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    if not prompts:
        raise UsageError("give at least one --prompt (or --prompts-file)")
    kwargs = engine_kwargs(args)
    params = sampling_params(args)
    model = resolve_model(args.model, "generate")
    from tilellm import LLM

    try:
        llm = LLM(model, **kwargs)
    except ValueError as e:  # the engine's documented error for a model it cannot run
        raise flag_error(e) from None
    use_tqdm = not args.no_progress
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=use_tqdm)
        else:
            outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    except ValueError as e:  # a prompt the model cannot take (too long, ids out of range)
        raise UsageError(str(e)) from None
    for prompt, out in zip(prompts, outs):
        if args.json:
            record = {
                "prompt": prompt,
                "prompt_tokens": len(out.prompt_token_ids),
                "outputs": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in out.outputs
                ],
            }
            print(json.dumps(record, ensure_ascii=False))
            continue
        for c in out.outputs:
            tag = f" [{c.index}]" if len(out.outputs) > 1 else ""
            print(f"Prompt{tag}: {prompt!r}")
            print(f"Output{tag}: {c.text!r}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    return 0
