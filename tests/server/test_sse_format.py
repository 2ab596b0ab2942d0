"""The streaming fast path serialises exactly what the generic JSON path would."""

from __future__ import annotations

import json

import pytest

from tilellm.server.serving import _ChunkWriter, _sse, plain_choice

TEXTS = ["", " hello", 'quote " and \\ backslash', "new\nline\ttab", "ünïcødé 中文 🙂", "\x00\x1f", "\ufffd"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("token_ids", [None, [], [7], [1, 151935, 0]])
@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_chunk_bytes(text, token_ids, include_usage):
    head = {"id": "cmpl-x", "object": "text_completion", "created": 17, "model": "m/ü"}
    generic = {"index": 3, "text": text, "logprobs": None, "finish_reason": None}
    if token_ids is not None:
        generic["token_ids"] = token_ids
    other = {"index": 4, "text": "x", "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    want = _sse({**head, "choices": [generic, other], **({"usage": None} if include_usage else {})})
    got = _ChunkWriter(head, include_usage)([plain_choice(3, "text", text, token_ids), other])
    assert got == want
    assert json.loads(got[len("data: ") :])["choices"][0]["text"] == text


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunk_bytes(text):
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 17, "model": "m"}
    generic = {"index": 1, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    want = _sse({**head, "choices": [generic]})
    assert _ChunkWriter(head, False)([plain_choice(1, "delta", text)]) == want
