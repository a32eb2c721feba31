r"""The judge output constraints (judging/formats.py), run through xgrammar's own matcher on the
embedded tokenizer: what they accept reads back through the parser as the verdict it spells;
what the parser could misread (text after the box, a second box, a value out of range, a hint
where none belongs) they refuse."""

from __future__ import annotations

import json

import pytest

from clawray.envs import make_family
from clawray.envs.llm_rewrite import REASON_MAX_CHARS, parse_rewrite, rewrite_schema
from clawray.judging.formats import answer_format, hint_format, output_format, verdict_format
from clawray.judging.parse import parse_hint_vote, parse_vote
from clawray.judging.prompts import JudgeRequest, TurnContext

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def accepts(tiny_tokenizer):
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tiny_tokenizer))

    def check(tag: str, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids) and matcher.is_completed()

    return check


@pytest.mark.parametrize("text, vote", [
    ("The user thanked the assistant.\n\\boxed{1}", 1),
    ("\\boxed{-1}", -1),
    ("Neither.\n\n\\boxed{0}", 0),
])
def test_a_verdict_format_accepts_reasoning_then_one_box_and_the_parser_reads_it(
        accepts, text, vote):
    assert accepts(verdict_format((1, -1, 0), 64), text)
    assert parse_vote(text) == vote


@pytest.mark.parametrize("text", [
    "\\boxed{2}",  # not a verdict value
    "\\boxed{1} but maybe not",  # text after the box
    "\\boxed{1} means progress. \\boxed{-1}",  # a second box (a quoted example)
    "It said \\(x\\). \\boxed{1}",  # a backslash in the reasoning
    "x" * 60 + "\\boxed{1}",  # reasoning longer than the token budget leaves room for
])
def test_a_verdict_format_refuses_what_the_parser_could_misread(accepts, text):
    assert not accepts(verdict_format((1, -1, 0), 64), text)


def test_the_step_rm_format_has_no_neutral_verdict(accepts):
    fmt = output_format(JudgeRequest("step_rm", [], _ctx()), 64, 600)
    assert accepts(fmt, "Progress.\\boxed{1}") and accepts(fmt, "\\boxed{-1}")
    assert not accepts(fmt, "\\boxed{0}")


def test_the_hint_format_takes_a_hint_only_with_the_positive_verdict(accepts):
    fmt = hint_format(max_tokens=128, hint_max_chars=40)
    good = "The user wanted km.\\boxed{1}[HINT_START]Give the distance in km.[HINT_END]"
    assert accepts(fmt, good)
    assert parse_hint_vote(good) == (1, "Give the distance in km.")
    assert accepts(fmt, "Nothing to learn.\\boxed{-1}")
    assert parse_hint_vote("Nothing to learn.\\boxed{-1}") == (-1, None)
    assert not accepts(fmt, "\\boxed{1}")  # a positive verdict needs its hint
    assert not accepts(fmt, "\\boxed{-1}[HINT_START]x[HINT_END]")
    assert not accepts(fmt, "\\boxed{1}[HINT_START]" + "k" * 41 + "[HINT_END]")  # too long


def test_a_rewrite_answers_with_one_point_inside_the_familys_box(accepts):
    family = make_family("household")
    fmt = answer_format(rewrite_schema(family), 512, REASON_MAX_CHARS + 24 * len(family.params))
    inside = [round((p.low + p.high) / 2, 2) for p in family.params]
    good = "Add a distractor.\n" + json.dumps({"params": inside, "reason": "more clutter"})
    assert accepts(fmt, good)
    assert parse_rewrite(good, family) == inside
    outside = [p.high + 1 for p in family.params]
    assert not accepts(fmt, json.dumps({"params": outside, "reason": "x"}))
    assert not accepts(fmt, json.dumps({"params": inside[:-1], "reason": "x"}))
    assert not accepts(fmt, json.dumps({"params": inside, "reason": "x" * (REASON_MAX_CHARS + 1)}))


def test_each_request_kind_gets_its_format():
    ctx = _ctx()
    assert output_format(JudgeRequest("prm", [], ctx), 64, 600) == verdict_format((1, -1, 0), 64)
    assert output_format(JudgeRequest("opd", [], ctx), 64, 600) == hint_format(64, 600)
    schema = {"type": "object"}
    assert output_format(JudgeRequest("env_rewrite", [], ctx, answer_schema=schema,
                                      answer_chars=10), 200, 600) == answer_format(schema, 200, 10)
    assert output_format(JudgeRequest("something else", [], ctx), 64, 600) is None


def _ctx() -> TurnContext:
    return TurnContext(history=[], request=[], response_text="", response_tool_calls=[],
                       next_state=[])
