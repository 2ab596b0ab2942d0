"""The shipped model: a loadable Hugging Face directory, small, and tilellm matches transformers on it."""

from __future__ import annotations

import json

import pytest
import torch

from tilellm.assets import default_model_path, demo_metadata
from tilellm.demo.task import conversations_for_model, problems_for_model

MODEL = default_model_path()
MAX_BYTES = 25 * 1024 * 1024


def _problems(n: int, seed: int = 99):
    return problems_for_model(demo_metadata(), n, seed)


def test_directory_is_complete_and_small():
    names = {p.name for p in MODEL.iterdir()}
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert required in names
    assert {"README.md", "tilellm_demo.json", "generation_config.json"} <= names
    size = sum(p.stat().st_size for p in MODEL.iterdir() if p.is_file())
    assert size <= MAX_BYTES, f"model directory is {size / 1e6:.1f} MB"
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    meta = demo_metadata()
    assert meta["prefix"].endswith("\n") and meta["min_digits"] <= meta["max_digits"]
    assert 0.0 < meta["accuracy_threshold"] <= meta["heldout_exact_match"] <= 1.0


def test_tokenizer_loads_offline(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    p = _problems(1)[0]
    ids = tok.encode(p.prompt)
    assert len(ids) == len(p.prompt)  # one token per character, no BOS
    assert tok.decode(ids) == p.prompt
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None
    chat = tok.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False)
    assert chat == p.prompt
    # A conversation renders the way training saw it: the instruction once, then "a+b=sum<eos>" turns.
    conv = conversations_for_model(demo_metadata(), 1, seed=3, min_turns=3, max_turns=3)[0]
    text = tok.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=True)
    assert text == conv.prompt and text.count(meta_prefix := demo_metadata()["prefix"]) == 1
    assert text.startswith(meta_prefix) and text.count(tok.eos_token) == 2
    assert tok.encode(text).count(tok.eos_token_id) == 2  # EOS is one token, not its spelling


def _transformers_greedy(prompts: list[str], max_new: int) -> list[list[int]]:
    """The oracle: transformers in fp32 on CPU, greedy, one step at a time (equal-length prompts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    x = torch.tensor([tok.encode(p) for p in prompts])
    outs: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(max_new):
            nxt = model(input_ids=x).logits[:, -1].argmax(-1)
            for o, t in zip(outs, nxt.tolist()):
                if not o or o[-1] != tok.eos_token_id:
                    o.append(t)
            x = torch.cat([x, nxt[:, None]], dim=1)
    return outs


def test_tilellm_matches_transformers():
    from tilellm import LLM, SamplingParams

    problems = _problems(12)
    prompts = [p.prompt for p in problems]
    max_new = max(len(p.answer) for p in problems) + 2
    want = _transformers_greedy(prompts, max_new)

    llm = LLM(model=str(MODEL), device="cpu", num_kv_blocks=64, max_num_seqs=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new))
    got = [list(o.outputs[0].token_ids) for o in outs]
    eos = llm.get_tokenizer().eos_token_id
    # tilellm stops at EOS and includes it; the oracle list also ends with EOS when it stopped.
    assert got == [w[: w.index(eos) + 1] if eos in w else w for w in want]
    correct = sum(p.is_correct(o.outputs[0].text) for p, o in zip(problems, outs))
    assert correct >= len(problems) - 1, [(p.question, o.outputs[0].text) for p, o in zip(problems, outs)]


@pytest.mark.parametrize("backend", ["reference"])
def test_chat_through_the_engine(backend):
    from tilellm import LLM, SamplingParams

    p = _problems(3, seed=5)
    llm = LLM(model=str(MODEL), device="cpu", num_kv_blocks=32, attention_backend=backend)
    outs = llm.chat(
        [[{"role": "user", "content": q.question}] for q in p], SamplingParams(temperature=0.0, max_tokens=8)
    )
    assert sum(q.is_correct(o.outputs[0].text) for q, o in zip(p, outs)) >= 2
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_multi_turn_conversations_answer_the_last_question():
    """Greedy through `LLM.chat`, on held-out conversations of 2-4 turns: the last sum is exact."""
    from tilellm import LLM, SamplingParams

    meta = demo_metadata()
    assert meta["multiturn_exact_match"] >= 0.95 and meta["multiturn_turns"] == [2, 4]
    convs = conversations_for_model(meta, 200, seed=17)
    assert {len(c.turns) for c in convs} == {2, 3, 4}
    llm = LLM(
        model=str(MODEL), device="cpu", num_kv_blocks=256, max_num_seqs=64, attention_backend="reference"
    )
    params = SamplingParams(temperature=0.0, max_tokens=8)
    texts = [o.outputs[0].text for o in llm.chat([c.messages for c in convs], params, use_tqdm=False)]
    wrong = [(c.prompt, t) for c, t in zip(convs, texts) if not c.is_correct(t)]
    assert len(wrong) <= 0.05 * len(convs), wrong[:5]
