"""A step's plan and result cross to the model workers and back through rpyc's serializer
(brine) unchanged: every field of every kind of plan (decodes, prompt chunks with their sampling,
drafts, every op) and result (tokens with and without top and prompt logprobs, errors, grammars),
and what crosses is only what brine carries by value."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from rpyc.core import brine

from lightllm.engine.plan import (OPS, Chunk, DraftRequest, SampledToken, StepPlan, StepResult, drafts_from_wire,
                                  drafts_to_wire, plan_from_wire, plan_to_wire, result_from_wire, result_to_wire)
from lightllm.engine.request import SamplingParams

ids = st.integers(0, 2**62)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=40)
logprobs = st.floats(allow_nan=False, max_value=0.0)  # -inf included
small_floats = st.floats(-100, 100, allow_nan=False)
sampling = st.none() | st.builds(SamplingParams, temperature=st.floats(0, 2), top_k=st.integers(-1, 50),
                                 stop_token_ids=st.lists(ids, max_size=3),
                                 logit_bias=st.dictionaries(ids, small_floats, max_size=3))
chunks = st.builds(Chunk, ids, tokens, st.integers(0, 10**6), st.booleans(), sampling,
                   st.lists(ids, max_size=4).map(tuple), st.integers(-1, 2**31), st.integers(0, 99), st.integers(-1, 99))
ops = st.one_of(*(st.builds(op) for op in OPS))


@st.composite
def plans(draw) -> StepPlan:
    decodes = draw(st.lists(ids, unique=True, max_size=30))
    drafting = draw(st.lists(st.sampled_from(decodes), unique=True)) if decodes else []
    drafts = {r: draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8)) for r in drafting}
    return StepPlan(draw(st.integers(-1, 2**40)), decodes, draw(st.lists(chunks, max_size=4)), draw(st.lists(ops, max_size=6)),
                    draw(st.booleans()), drafts)


tops = st.none() | st.lists(st.tuples(ids, logprobs), max_size=4).map(tuple)
prompts = st.none() | st.lists(st.tuples(logprobs, st.lists(st.tuples(ids, logprobs), max_size=2).map(tuple)),
                               max_size=3).map(tuple)
sampled = st.builds(SampledToken, ids, st.integers(0, 2**31 - 1), logprobs, tops, prompts)
results = st.none() | st.builds(StepResult, st.integers(-1, 2**40), st.lists(sampled, max_size=40), st.none() | st.text(),
                                st.lists(st.tuples(ids, st.none() | st.text()), max_size=3))


def cross(wire):
    """As rpyc's serializer carries it (it refuses what it cannot carry by value)."""
    return brine.load(brine.dump(wire))


@settings(max_examples=300, deadline=None)
@given(plans())
def test_a_plan_crosses_unchanged(plan):
    assert plan_from_wire(cross(plan_to_wire(plan))) == plan


@settings(max_examples=300, deadline=None)
@given(results)
def test_a_result_crosses_unchanged(result):
    got = result_from_wire(cross(result_to_wire(result)))
    assert got == result
    if result is not None:  # and the sign of a zero logprob, which == does not see
        assert [math.copysign(1, t.logprob) for t in got.tokens] == [math.copysign(1, t.logprob) for t in result.tokens]


@given(st.lists(st.builds(DraftRequest, ids, st.integers(0, 10**6), tokens.map(tuple), st.integers(0, 8)), max_size=8))
def test_draft_asks_cross_unchanged(asks):
    assert drafts_from_wire(cross(drafts_to_wire(asks))) == asks


