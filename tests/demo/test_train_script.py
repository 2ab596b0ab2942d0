"""tools/train_tiny_model.py end to end, a few steps: it writes a complete, loadable directory and
never replaces an existing model with one below --min-accuracy."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import torch

from tilellm.demo.task import PREFIX, held_out_conversations

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_tiny_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_short_run_writes_a_model_dir(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = _load_script()
    threads = torch.get_num_threads()
    out = tmp_path / "m"
    args = ["--device", "cpu", "--steps", "3", "--batch-size", "4", "--eval-size", "4", "--eval-every", "0"]
    try:
        assert train.main([*args, "--out", str(out)]) == 0
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
        assert {"README.md", "tilellm_demo.json", "generation_config.json"} <= names
        meta = json.loads((out / "tilellm_demo.json").read_text())
        assert meta["train"]["steps"] == 3 and 0.0 <= meta["heldout_exact_match"] <= 1.0
        assert 0.0 <= meta["multiturn_exact_match"] <= 1.0 and meta["multiturn_conversations"] == 4
        tok = AutoTokenizer.from_pretrained(str(out))
        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert model.config.architectures == ["Qwen3ForCausalLM"]
        assert tok.decode(tok.encode("12+34=")) == "12+34="
        conv = held_out_conversations(1, seed=4, min_turns=3, max_turns=3)[0]
        assert tok.apply_chat_template(conv.messages, tokenize=False) == conv.prompt
        readme = (out / "README.md").read_text()
        assert "--max-turns 5 --multi-turn-start 0.4" in readme and "conversations of 2 to 4 turns" in readme

        # An impossible bar: exit 1, the existing directory stays as it was.
        before = (out / "model.safetensors").read_bytes()
        assert train.main([*args, "--seed", "1", "--min-accuracy", "1.01", "--out", str(out)]) == 1
        assert (out / "model.safetensors").read_bytes() == before
        assert (tmp_path / "m.new" / "model.safetensors").is_file()
    finally:
        torch.set_num_threads(threads)


def test_multi_turn_batches_put_loss_on_every_answer():
    train = _load_script()
    tok = train.build_tokenizer()
    eos, pad = tok.token_to_id(train.EOS), tok.token_to_id(train.PAD)
    x, y = train.make_batch(tok, random.Random(0), 4, eos, pad, (4, 4), turns=3)
    assert x.shape[0] == 4
    for row, lab in zip(x.tolist(), y.tolist()):
        text = tok.decode([t for t in row if t != pad], skip_special_tokens=False)
        turns = text.split(train.EOS)[:-1]
        assert len(turns) == 3 and row.count(eos) == 3
        for turn in turns:  # each turn "a+b=sum", and the sum is right
            question, answer = turn.split("=")
            a, b = map(int, question.split("+"))
            assert int(answer) == a + b
        labelled = [t for t in lab if t != -100]
        assert tok.decode(labelled, skip_special_tokens=False) == "".join(
            t.split("=")[1] + train.EOS for t in turns
        )


def test_instruction_reaches_the_training_forward():
    """The shared-prefix forward the script trains with gives the logits of the full prompt."""
    train = _load_script()
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    tok = train.build_tokenizer()
    model = Qwen3ForCausalLM(train.model_config(128)).eval()
    prefix = torch.tensor([train.encode(tok, PREFIX)])
    x = torch.tensor([train.encode(tok, "1234+5678=6912")] * 2)
    with torch.no_grad():
        shared = train.shared_prefix_logits(model, prefix, x)
        full = model(input_ids=torch.cat([prefix.expand(2, -1), x], dim=1)).logits[:, prefix.shape[1] :]
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
