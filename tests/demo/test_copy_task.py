"""The record-edit task (tilellm/demo/copy_task.py) and tools/train_copy_model.py, a few steps."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from tilellm.demo import copy_task
from tilellm.demo.copy_task import (
    KEYS,
    MAX_LEN,
    MAX_TOKENS,
    MIN_LEN,
    PREFIX,
    RecordEdit,
    held_out_problems,
    is_held_out,
    problems_for_model,
    sample_problem,
)

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_copy_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_copy_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fields(text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(";"):
        k, v = part.split("=")
        out.append((k, v))
    return out


def _samples(n: int = 300, seed: int = 0) -> list[RecordEdit]:
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def test_the_example_of_the_module_docstring():
    p = RecordEdit(
        (("name", "alice"), ("age", "31"), ("city", "paris"), ("color", "blue"), ("job", "cook")),
        "city",
        "oslo",
    )
    assert p.prompt == (
        "Rewrite the record with the change.\n"
        "set city=oslo\n"
        "name=alice;age=31;city=paris;color=blue;job=cook\n"
    )
    assert p.answer == "name=alice;age=31;city=oslo;color=blue;job=cook"
    assert p.old_value == "paris" and p.question == "set city=oslo\n" + p.record
    assert p.is_correct(p.answer) and p.is_correct(f" {p.answer}\n")
    assert not p.is_correct(p.record) and not p.is_correct(p.answer + ";")


def test_keys_are_unambiguous():
    assert len(set(KEYS)) == len(KEYS)
    assert all(k.isalpha() and k.islower() for k in KEYS)
    for a in KEYS:
        for b in KEYS:
            if a != b:
                assert not b.startswith(a) and not b.endswith(a), (a, b)
    assert len({k[-2:] for k in KEYS}) == len(KEYS)


@pytest.mark.parametrize("held_out", [False, True])
def test_prompt_and_answer_shape(held_out):
    problems = _samples(200) if not held_out else held_out_problems(50, seed=3)
    for p in problems:
        assert p.prompt.startswith(PREFIX) and p.prompt.endswith("\n")
        instruction, change, record, tail = p.prompt.split("\n")
        assert instruction + "\n" == PREFIX and tail == ""
        assert change == f"set {p.key}={p.value}" and record == p.record
        fields = _fields(record)
        keys = [k for k, _ in fields]
        assert len(set(keys)) == len(keys) and set(keys) <= set(KEYS)
        assert copy_task.MIN_FIELDS <= len(fields) <= copy_task.MAX_FIELDS
        assert p.key in keys
        for _, v in fields + [(p.key, p.value)]:
            assert v and (v.isdigit() or (v.isalpha() and v.islower()))
            assert not (v.isdigit() and len(v) > 1 and v[0] == "0")
        assert "\n" not in p.answer and p.answer.isascii()


def test_answer_differs_from_the_record_in_exactly_the_updated_field():
    for p in _samples(300):
        before, after = _fields(p.record), _fields(p.answer)
        assert [k for k, _ in before] == [k for k, _ in after]
        changed = [(kb, vb, va) for (kb, vb), (_, va) in zip(before, after) if vb != va]
        assert changed == [(p.key, p.old_value, p.value)]
        # Everything but the new value is a copy of the prompt's record.
        i = p.answer.index(f"{p.key}={p.value}") + len(p.key) + 1
        assert p.answer[:i] + p.old_value + p.answer[i + len(p.value) :] == p.record


def test_lengths_fit_the_models_positions():
    train = _load_script()
    problems = _samples(2000, seed=1) + held_out_problems(100, seed=1)
    for p in problems:
        assert MIN_LEN <= len(p.record) <= MAX_LEN and MIN_LEN <= len(p.answer) <= MAX_LEN
        assert len(p.prompt) + len(p.answer) + 1 <= MAX_TOKENS  # one token per character, and EOS
    assert MAX_TOKENS <= train.MAX_POSITIONS == train.model_config(128, 4).max_position_embeddings
    mean = sum(len(p.answer) for p in problems) / len(problems)
    assert 80 <= mean <= 100


def test_held_out_split_is_fixed_and_disjoint():
    a = held_out_problems(40, seed=7)
    assert a == held_out_problems(40, seed=7)
    assert a != held_out_problems(40, seed=8)
    assert len(set(a)) == 40 and all(is_held_out(p) for p in a)
    assert not any(is_held_out(p) for p in _samples(2000, seed=2))
    # The class of a problem depends on the record and the change only: not on a seed, not on the
    # instruction, and it is the same on every run (no salted hash).
    p = a[0]
    assert is_held_out(RecordEdit(p.fields, p.key, p.value, prefix="Another instruction.\n"))
    assert problems_for_model({"prefix": PREFIX}, 5, seed=7) == a[:5]
    example = RecordEdit((("name", "alice"), ("city", "paris")), "city", "oslo")
    assert is_held_out(example) is False
    # About 1 problem in HELD_OUT_MODULUS is held out.
    rng = random.Random(5)
    share = sum(is_held_out(copy_task._sample(rng, PREFIX)) for _ in range(10_000)) / 10_000
    assert 0.5 / copy_task.HELD_OUT_MODULUS < share < 1.5 / copy_task.HELD_OUT_MODULUS


def test_held_out_problems_are_reproducible_across_processes():
    """The same problems in a fresh interpreter (with another PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys

    code = "from tilellm.demo.copy_task import held_out_problems as h; print(h(3, seed=11)[2].prompt)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout == held_out_problems(3, seed=11)[2].prompt + "\n"


# --- tools/train_copy_model.py -------------------------------------------------------------------


def test_encoding_and_chat_template_match_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    train = _load_script()
    tok = train.build_tokenizer()
    table = train.char_table(tok)
    for p in _samples(20):
        text = p.prompt + p.answer
        assert train.encode(table, text).tolist() == tok.encode(text, add_special_tokens=False).ids
    train.save_tokenizer(tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    p = held_out_problems(1, seed=2)[0]
    assert hf.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False) == p.prompt
    assert hf.decode(hf.encode(p.prompt)) == p.prompt and len(hf.encode(p.prompt)) == len(p.prompt)
    assert hf.model_max_length == train.MAX_POSITIONS


def test_batches_put_loss_on_the_answer_and_eos_only():
    train = _load_script()
    tok = train.build_tokenizer()
    table = train.char_table(tok)
    eos, pad = tok.token_to_id(train.EOS), tok.token_to_id(train.PAD)
    x, y = train.batch_for_step(3, table, 0, 6, eos, pad)
    x2, y2 = train.batch_for_step(3, table, 0, 6, eos, pad)
    assert (x == x2).all() and (y == y2).all()
    assert x.tolist() != train.batch_for_step(4, table, 0, 6, eos, pad)[0].tolist()
    for row, lab in zip(x.tolist(), y.tolist()):
        text = tok.decode([t for t in row if t != pad], skip_special_tokens=False)
        assert text.startswith(PREFIX) and text.endswith(train.EOS) and text.count(train.EOS) == 1
        prompt, answer = text.removesuffix(train.EOS).rsplit("\n", 1)
        record = prompt.split("\n")[2]
        assert len(_fields(record)) == len(_fields(answer))
        labelled = [t for t in lab if t != -100]
        assert tok.decode(labelled, skip_special_tokens=False) == answer + train.EOS
        # Labels line up with the inputs (the loss shifts them by one).
        assert all(t == -100 or t == r for t, r in zip(lab, row))


def test_worker_processes_build_the_same_batches():
    train = _load_script()
    tok = train.build_tokenizer()
    args = (train.char_table(tok), 5, 4, tok.token_to_id(train.EOS), tok.token_to_id(train.PAD))
    local, pooled = train.Batches(0, 5, args), train.Batches(2, 5, args)
    try:
        for step in range(5):
            (a, b), (c, d) = local.get(step), pooled.get(step)
            assert (a == c).all() and (b == d).all()
    finally:
        pooled.close()


def test_padded_greedy_decoding_matches_one_prompt_at_a_time():
    from transformers import Qwen3ForCausalLM

    train = _load_script()
    torch.manual_seed(0)
    tok = train.build_tokenizer()
    table = train.char_table(tok)
    eos, pad = tok.token_to_id(train.EOS), tok.token_to_id(train.PAD)
    model = Qwen3ForCausalLM(train.model_config(128, 1)).eval()
    prompts = [p.prompt for p in held_out_problems(3, seed=4)]
    assert len({len(p) for p in prompts}) > 1
    batched = train.greedy_completions(model, table, tok, prompts, eos, pad, "cpu", chunk=8)
    for prompt, got in zip(prompts, batched):
        x = torch.from_numpy(train.encode(table, prompt))[None]
        with torch.no_grad():
            for _ in range(12):
                nxt = model(input_ids=x).logits[0, -1].argmax()
                if nxt.item() == eos:
                    break
                x = torch.cat([x, nxt.view(1, 1)], dim=1)
        want = tok.decode(x[0, len(prompt) :].tolist())
        assert got[: len(want)] == want


def test_short_run_writes_a_model_dir(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = _load_script()
    threads = torch.get_num_threads()
    out = tmp_path / "m"
    args = ["--device", "cpu", "--steps", "3", "--batch-size", "4", "--layers", "1"]
    args += ["--eval-size", "4", "--eval-every", "0", "--warmup", "2"]
    try:
        assert train.main([*args, "--out", str(out)]) == 0
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
        assert {
            "README.md",
            "tilellm_demo.json",
            "generation_config.json",
            "special_tokens_map.json",
        } <= names
        meta = json.loads((out / "tilellm_demo.json").read_text())
        assert meta["task"] == "record-edit" and meta["prefix"] == PREFIX
        assert meta["train"]["steps"] == 3 and meta["heldout_problems"] == 4
        assert 0.0 <= meta["heldout_exact_match"] <= 1.0 and 0.85 < meta["copied_share"] < 1.0
        config = json.loads((out / "config.json").read_text())
        assert config["max_position_embeddings"] == 320 and config["torch_dtype"] == "bfloat16"
        assert config["rope_theta"] == 10000.0 and config["num_hidden_layers"] == 1
        tok = AutoTokenizer.from_pretrained(str(out))
        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert model.config.architectures == ["Qwen3ForCausalLM"]
        assert model.dtype == torch.bfloat16 and model.generation_config.eos_token_id == tok.eos_token_id
        p = problems_for_model(meta, 1, seed=9)[0]
        assert tok.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False) == p.prompt
        readme = (out / "README.md").read_text()
        cmd = "python tools/train_copy_model.py --device cpu --steps 3 --batch-size 4 --lr 0.003 --warmup 2"
        assert cmd + " --layers 1 --seed 0" in readme and "--min-accuracy 0.0" in readme
        assert "# tiny-copy" in readme and "held-out problems" in readme

        # An impossible bar: exit 1, the existing directory stays as it was.
        before = (out / "model.safetensors").read_bytes()
        assert train.main([*args, "--seed", "1", "--min-accuracy", "1.01", "--out", str(out)]) == 1
        assert (out / "model.safetensors").read_bytes() == before
        assert (tmp_path / "m.new" / "model.safetensors").is_file()
    finally:
        torch.set_num_threads(threads)
