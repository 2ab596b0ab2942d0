"""tools/train_tiny_model.py end to end, a few steps: it writes a complete, loadable directory and
never replaces an existing model with one below --min-accuracy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

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
        tok = AutoTokenizer.from_pretrained(str(out))
        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert model.config.architectures == ["Qwen3ForCausalLM"]
        assert tok.decode(tok.encode("12+34=")) == "12+34="

        # An impossible bar: exit 1, the existing directory stays as it was.
        before = (out / "model.safetensors").read_bytes()
        assert train.main([*args, "--seed", "1", "--min-accuracy", "1.01", "--out", str(out)]) == 1
        assert (out / "model.safetensors").read_bytes() == before
        assert (tmp_path / "m.new" / "model.safetensors").is_file()
    finally:
        torch.set_num_threads(threads)
