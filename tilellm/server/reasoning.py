"""Reasoning parsers: the model's thinking, split from its answer (`--reasoning-parser`).

    parser = get_reasoning_parser("qwen3")
    reasoning, content = parser.split(text)          # a whole output
    stream = parser.stream()
    reasoning_delta, content_delta = stream.feed(delta_text)   # streamed, in order

Qwen3 writes its thinking first, between `<think>` and `</think>`, then the answer; with
thinking off (`chat_template_kwargs={"enable_thinking": false}`) the template writes an empty
think block into the prompt and the output is all answer. An output that does not start with
`<think>` is all content; one that opens it and never closes it (cut by `max_tokens`) is all
reasoning. The chat API returns the thinking as `reasoning_content` (vLLM's name).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTagParser:
    """Thinking between `start` and `end` tags at the start of the output (see the module docstring)."""

    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when the output has none, content)."""
        body = text.lstrip()
        if not body.startswith(self.start):
            return None, text
        body = body[len(self.start) :]
        reasoning, found, content = body.partition(self.end)
        if not found:
            return reasoning, ""
        return reasoning, content.lstrip("\n")

    def stream(self) -> ThinkTagStream:
        return ThinkTagStream(self)


class ThinkTagStream:
    """`ThinkTagParser.split` over streamed text: each `feed` returns the new reasoning and the new
    content. A tag split across deltas is held back until it is whole (or cannot be a tag)."""

    def __init__(self, parser: ThinkTagParser):
        self.parser = parser
        self.state = "start"  # start: nothing decided yet; reasoning; content
        self.pending = ""  # text held back: the possible start of a tag
        self.strip_newlines = False  # content right after the end tag drops leading newlines

    def feed(self, text: str) -> tuple[str, str]:
        p = self.parser
        buf = self.pending + text
        self.pending = ""
        reasoning = content = ""
        if self.state == "start":
            head = buf.lstrip()
            if head.startswith(p.start):
                self.state = "reasoning"
                buf = head[len(p.start) :]
            elif p.start.startswith(head):  # could still become the start tag
                self.pending = buf
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            before, found, after = buf.partition(p.end)
            if found:
                reasoning = before
                self.state, self.strip_newlines = "content", True
                buf = after
            else:
                keep = _partial_suffix(buf, p.end)
                reasoning, self.pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
                return reasoning, ""
        if self.state == "content":
            if self.strip_newlines:
                stripped = buf.lstrip("\n")
                if stripped:
                    self.strip_newlines = False
                buf = stripped
            content = buf
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the output."""
        held, self.pending = self.pending, ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_PARSERS = {"qwen3": ThinkTagParser(), "deepseek_r1": ThinkTagParser()}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ThinkTagParser:
    if name not in _PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(reasoning_parser_names())}"
        )
    return _PARSERS[name]
