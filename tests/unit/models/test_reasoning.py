"""The reasoning split: whole replies, and the same result for any split into stream deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clawray.models.reasoning import ReasoningParser, split_reasoning


@pytest.mark.parametrize("text, prefilled, want", [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, ("\nweigh it\n", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("plain answer", False, (None, "plain answer")),
    ("answer <think>not reasoning</think>", False,
     (None, "answer <think>not reasoning</think>")),
    ("<think>cut by max_tokens", False, ("cut by max_tokens", "")),
    ("prefilled thought</think>\nok", True, ("prefilled thought", "ok")),
    ("<think></think>ok", False, ("", "ok")),
    ("<thin", False, (None, "<thin")),
    ("", False, (None, "")),
])
def test_whole_replies(text, prefilled, want):
    assert split_reasoning(text, prefilled) == want


PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think>", "a", " ", "\n",
                                   "b c", "<th", "ink>", "</thi"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 60), max_size=6),
       prefilled=st.booleans())
def test_any_split_into_deltas_gives_the_same_split(pieces, cuts, prefilled):
    text = "".join(pieces)
    want_reasoning, want_content = split_reasoning(text, prefilled)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parser = ReasoningParser(prefilled)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out += parser.feed(text[a:b])
    out += parser.finish()
    assert "".join(t for k, t in out if k == "content") == want_content
    assert "".join(t for k, t in out if k == "reasoning") == (want_reasoning or "")
    assert all(t for _, t in out)  # no empty pieces
