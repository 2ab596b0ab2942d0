"""Structured outputs (xgrammar token masks): whatever the random model prefers, a constrained
output that ends by itself parses and validates; batches mix constrained and free requests;
asynchronous scheduling, preemption and n > 1 keep it; a grammar that cannot compile is a
ValueError naming structured_outputs, with nothing allocated."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tilellm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        # (no maxLength: xgrammar 0.2.9 lets raw control characters into length-bounded strings)
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-\d\d"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "A" ("B" | "C")* "."'

FORMS = {
    "json_schema": (
        StructuredOutputsParams(json=SCHEMA),
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    "json_object": (
        StructuredOutputsParams(json_object=True),
        lambda t: isinstance(json.loads(t), dict) or 1 / 0,
    ),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or 1 / 0),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or 1 / 0),
    "grammar": (StructuredOutputsParams(grammar=GRAMMAR), lambda t: re.fullmatch(r"A[BC]*\.", t) or 1 / 0),
}
PROMPTS = ["Hello", "Write the record as JSON:", "x" * 30, "1 2 3"]


def _check_outputs(outs, check) -> int:
    """Every output that ended by itself validates; returns how many did."""
    ended = 0
    for out in outs:
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                check(sample.text)
                ended += 1
            else:
                assert sample.finish_reason == "length"
    return ended


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_validates(tiny_qwen3, form, temperature):
    so, check = FORMS[form]
    llm = LLM(tiny_qwen3, num_kv_blocks=128)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=120, structured_outputs=so)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ended = _check_outputs(outs, check)
    if form in ("regex", "choice"):  # bounded languages always end
        assert ended == len(PROMPTS)


@pytest.mark.parametrize("setting", ["async", "tiny_pool_preempts", "speculative_free_requests"])
def test_mixed_batches_and_engine_settings(tiny_qwen3, setting):
    kwargs = dict(num_kv_blocks=128)
    if setting == "tiny_pool_preempts":
        kwargs = dict(num_kv_blocks=5, max_num_seqs=8)
    if setting == "speculative_free_requests":
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
        }
    llm = LLM(tiny_qwen3, **kwargs)
    llm.llm_engine.async_scheduling = setting == "async"
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    regex = SamplingParams(temperature=0.8, seed=1, max_tokens=24, n=2, structured_outputs=FORMS["regex"][0])
    choice = SamplingParams(temperature=0, max_tokens=24, structured_outputs=FORMS["choice"][0])
    prompts = PROMPTS * 2
    params = [free, regex, choice, free] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    want_free = LLM(tiny_qwen3, num_kv_blocks=128).generate(prompts[::4], free, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[4].outputs[0].token_ids] == [
        o.outputs[0].token_ids for o in want_free
    ]
    assert _check_outputs([outs[1], outs[5]], FORMS["regex"][1]) == 4
    assert _check_outputs([outs[2], outs[6]], FORMS["choice"][1]) == 2
    assert not llm.llm_engine._constrained  # every grammar's state released
    if setting == "tiny_pool_preempts":
        assert llm.llm_engine.get_stats().num_preemptions > 0


def test_a_grammar_that_cannot_compile_is_a_value_error(tiny_qwen3):
    llm = LLM(tiny_qwen3, num_kv_blocks=16)
    for so in (StructuredOutputsParams(regex="(unclosed"), StructuredOutputsParams(grammar="root ::= ")):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["hi"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.requests and llm.llm_engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(json=SCHEMA, regex="a"), dict(choice=[]), dict(regex=""), dict(json=3)],
)
def test_bad_structured_outputs_params(kwargs):
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_asynchronous_steps_give_the_synchronous_outputs(tiny_qwen3, temperature):
    """Constrained steps stay asynchronous: the step before is read back (and its tokens fed to the
    matchers) only once this step's forward is launched, and the outputs equal synchronous ones."""
    params = [
        SamplingParams(temperature=temperature, seed=5 + i, max_tokens=40, structured_outputs=FORMS[f][0])
        for i, f in enumerate(["json_schema", "regex", "choice", "grammar"])
    ] + [SamplingParams(temperature=temperature, seed=9, max_tokens=40, ignore_eos=True)]
    prompts = PROMPTS + PROMPTS[:1]
    outs = {}
    for asynchronous in (False, True):
        llm = LLM(tiny_qwen3, num_kv_blocks=128)
        engine = llm.llm_engine
        engine.async_scheduling = asynchronous
        in_flight = []
        fill = engine._fill_bitmask

        def spy(rows, early, fill=fill, engine=engine, in_flight=in_flight):
            in_flight.append(engine._inflight is not None)
            return fill(rows, early)

        engine._fill_bitmask = spy
        outs[asynchronous] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert any(in_flight) == asynchronous  # a step was still in flight when the mask was filled
    assert outs[True] == outs[False]


def test_length_bounded_strings_parse(tiny_qwen3):
    """xgrammar's own minLength / maxLength strings admit raw control characters (invalid JSON);
    the backend masks JSON rows by the tokens free of control bytes, so every finished output
    parses and validates."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 6}},
        "required": ["name"],
        "additionalProperties": False,
    }
    llm = LLM(tiny_qwen3, num_kv_blocks=128)
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, n=8, structured_outputs=so)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ended = 0
    for out in outs:
        for c in out.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
                ended += 1
    assert ended >= len(PROMPTS)
