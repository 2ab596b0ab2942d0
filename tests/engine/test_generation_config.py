"""Default sampling values from generation_config.json (`generation_config`: auto, vllm, DIR)."""

from __future__ import annotations

import json
import shutil

import pytest

from tilellm import LLM, SamplingParams
from tilellm.engine.generation_config import default_sampling_values


@pytest.fixture(scope="module")
def greedy_by_default(tiny_qwen3, tmp_path_factory):
    """The tiny model whose generation_config.json asks for greedy decoding and a penalty."""
    path = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(tiny_qwen3, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_p=0.5, repetition_penalty=1.3, max_new_tokens=7)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


def test_values_read(greedy_by_default, tiny_qwen3):
    want = {"temperature": 0.0, "top_p": 0.5, "repetition_penalty": 1.3, "max_tokens": 7}
    assert default_sampling_values(greedy_by_default) == want
    assert default_sampling_values(greedy_by_default, "vllm") == {}
    assert default_sampling_values(tiny_qwen3, greedy_by_default) == want  # another directory's
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling_values(tiny_qwen3, "/no/such/dir")


def test_generate_without_params_uses_them(greedy_by_default):
    llm = LLM(greedy_by_default, num_kv_blocks=32)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.0, 1.3, 7)
    a = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    want = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=7), use_tqdm=False
    )
    assert a == b == want[0].outputs[0].token_ids and len(a) <= 7
    # what a caller passes wins
    explicit = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(explicit.token_ids) <= 3


def test_vllm_source_ignores_the_file(greedy_by_default):
    llm = LLM(greedy_by_default, num_kv_blocks=32, generation_config="vllm")
    assert llm.get_default_sampling_params().temperature == 1.0


def test_a_bad_directory_fails_before_loading(tiny_qwen3):
    with pytest.raises(ValueError, match="generation_config"):
        LLM(tiny_qwen3, generation_config="/no/such/dir")
