"""Grammar-constrained decoding on the shipped model (offline engine): outputs match their constraint where the
unconstrained model's do not, speculative decoding gives exactly the constrained output of plain decoding (draft
tokens are checked against the grammar), and bad constraints are errors that name their field."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from llm_backend import LLM, SamplingParams
from llm_backend.agentic.grammar import ConstraintSpec, GrammarCompilerPool, GrammarError, tokenizer_info
from llm_backend.server.chat_template import load_chat_template
from mimo_epd.train.samples import TOOLS

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 80}},
    "required": ["topic", "summary"],
    "additionalProperties": False,
}
QUESTIONS = ["What is a list?", 'Explain dict. Reply with a JSON object with the keys "topic" and "summary".']


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", speculative_steps=2)


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny")


@pytest.fixture(scope="module")
def pool(plain):
    return GrammarCompilerPool(tokenizer_info(plain.tokenizer, plain.model.config.vocab_size, plain._eos))


def prompts(**kw):
    tpl = load_chat_template("tiny")
    return [tpl.render([{"role": "user", "content": q}], **kw) for q in QUESTIONS]


def run(engine, spec, pool, max_tokens=120, **kw):
    grammar = pool.compile_sync(spec) if spec is not None else None
    params = SamplingParams(max_tokens=max_tokens, grammar=grammar, **kw)
    return engine.generate(prompts(**({"enable_thinking": True} if spec is not None and spec.thinking else {})), params)


def test_json_schema_outputs_validate_and_speculation_changes_nothing(plain, llm, pool):
    spec = ConstraintSpec("json_schema", SCHEMA, "response_format")
    outs = run(plain, spec, pool)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert [o.text for o in run(llm, spec, pool)] == [o.text for o in outs]
    for engine in (plain, llm):  # sampled (speculation is lossless in distribution, not draw for draw)
        for o in run(engine, spec, pool, temperature=0.8, seed=3):
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMA)
    free = run(plain, None, pool)  # the same prompts unconstrained: not this schema's JSON
    assert not all(_valid(o.text) for o in free)


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_regex_choice_ebnf_and_strict_tool_calls(plain, llm, pool):
    for o in run(plain, ConstraintSpec("regex", r"[A-Z][a-z]{2,8}-[0-9]{2}", "regex"), pool, max_tokens=30):
        assert re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{2}", o.text), o.text
    for o in run(plain, ConstraintSpec("choice", ["yes", "no", "maybe"], "choice"), pool, max_tokens=30):
        assert o.text in ("yes", "no", "maybe")
    for o in run(plain, ConstraintSpec("ebnf", 'root ::= "(" [a-z]{1,20} ")"', "grammar"), pool, max_tokens=30):
        assert re.fullmatch(r"\([a-z]+\)", o.text), o.text
    tools = ConstraintSpec(
        "tools",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "run_python"}}},
        "tool_choice",
    )
    outs = run(plain, tools, pool)
    for o in outs:
        assert o.text.startswith("<tool_call>\n<function=run_python>\n<parameter=code>\n"), o.text
    assert [o.text for o in run(llm, tools, pool)] == [o.text for o in outs]


def test_thinking_stays_free_before_the_constraint(plain, pool):
    spec = ConstraintSpec("json_schema", SCHEMA, "response_format", thinking=True)
    for o in run(plain, spec, pool, max_tokens=200):
        if o.finish_reason == "stop":
            reasoning, _, answer = o.text.partition("</think>\n\n")
            assert "</think>" not in reasoning
            jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(plain, pool):
    (o, _) = run(plain, ConstraintSpec("regex", r"a{50}", "regex"), pool, max_tokens=5)
    assert o.finish_reason == "length" and set(o.text) <= {"a"}


@pytest.mark.parametrize(
    "spec",
    [
        ConstraintSpec("regex", r"[0-9", "regex"),
        ConstraintSpec("ebnf", "root ::= undefined_rule", "grammar"),
        ConstraintSpec(
            "json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "response_format"
        ),
    ],
)
def test_bad_constraints_name_their_field(pool, spec):
    with pytest.raises(GrammarError) as e:
        asyncio.run(pool.compile(spec))
    assert e.value.param == spec.param and "[" not in e.value.detail[:1]


def test_compiles_are_cached_by_their_schema(pool):
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"zz": {"type": "integer"}}}, "x")
    hits = pool.stats.cache_hits
    g1 = asyncio.run(pool.compile(spec))
    g2 = asyncio.run(
        pool.compile(ConstraintSpec("json_schema", {"properties": {"zz": {"type": "integer"}}, "type": "object"}, "x"))
    )
    assert g1 is g2 and pool.stats.cache_hits == hits + 1


def test_sampling_controls_compose_with_a_grammar_and_speculation(plain, llm, pool):
    """Penalties, logit_bias and min_tokens under a JSON schema: the output still validates (the grammar masks the
    adjusted row), the penalties change it, and speculation gives exactly plain decoding's answer (verification
    uses the same adjusted, masked distribution)."""
    spec = ConstraintSpec("json_schema", SCHEMA, "response_format")
    controls = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2, min_tokens=5)
    adjusted = run(plain, spec, pool, **controls)
    for o in adjusted:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert [o.text for o in adjusted] != [o.text for o in run(plain, spec, pool)]
    assert [o.text for o in run(llm, spec, pool, **controls)] == [o.text for o in adjusted]
