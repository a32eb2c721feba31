"""Verdict parsing, vote aggregation, hint parsing and the OPD helpers (pure functions)."""

from __future__ import annotations


import pytest

from clawray.judging.opd import (
    HINT_HEADER,
    inject_hint,
    is_ephemeral_context,
    select_hint,
)
from clawray.judging.parse import aggregate, parse_hint_vote, parse_vote, tally
from clawray.judging.prompts import EXAMPLES_END, EXAMPLES_START, OPD_SYSTEM, PRM_SYSTEM


# ---------------------------------------------------------------------------- parse_vote
@pytest.mark.parametrize("box, vote", [
    ("1", 1), ("+1", 1), ("-1", -1), ("0", 0), ("1.0", 1), ("+1.0", 1), ("-1.0", -1),
    ("0.0", 0), ("-0", 0), ("+0", 0), (" 1 ", 1), ("  -1\n", -1), ("\u22121", -1),
    ("{1}", 1), ("\\text{-1}", -1), ("\\textbf{ 0 }", 0),
])
def test_accepted_box_values(box, vote):
    assert parse_vote(f"Reasoning... \\boxed{{{box}}}") == vote


@pytest.mark.parametrize("box", ["2", "yes", "0.5", "", " ", "1.5", "-2", "+", "11", "1e0",
                                 "\\text{yes}"])
def test_invalid_box_values_are_parse_failures(box):
    assert parse_vote(f"so \\boxed{{{box}}}") is None


def test_no_box_or_unclosed_box_is_a_parse_failure():
    assert parse_vote("The answer is 1.") is None
    assert parse_vote("") is None
    assert parse_vote("\\boxed{1") is None


def test_last_box_wins():
    assert parse_vote("First \\boxed{1}, then on reflection \\boxed{-1}") == -1
    assert parse_vote("\\boxed{-1}\n\\boxed{1}") == 1
    assert parse_vote("\\boxed{1}\n\\boxed{1}") == 1  # a repeated verdict is not an enumeration


def test_an_invalid_last_box_is_not_replaced_by_an_earlier_valid_one():
    assert parse_vote("\\boxed{1} ... final: \\boxed{2}") is None


def test_nested_braces_are_matched():
    assert parse_vote("\\boxed{{-1}}") == -1
    assert parse_vote("\\boxed{\\text{1}} trailing") == 1
    # the inner braces belong to the box, so the box holds "\frac{1}{2}": invalid
    assert parse_vote("\\boxed{\\frac{1}{2}}") is None
    assert parse_vote("\\boxed {0}") == 0


def test_glossed_boxes_are_mentions_not_verdicts():
    text = ("The rubric says \\boxed{1} means progress. I would write \\boxed{-1} if the user "
            "asked to redo it. The user thanked the assistant, so: \\boxed{1}")
    assert parse_vote(text) == 1
    # Without the final verdict the glossed mentions do not count: a parse failure, not -1.
    assert parse_vote("I should answer \\boxed{-1} if the user asked to redo it.") is None
    assert parse_vote('Recall "\\boxed{0}" = ambiguous. Verdict: \\boxed{-1}') == -1


def test_enumerated_boxes_are_mentions():
    text = "I must end with one of \\boxed{1}, \\boxed{-1} or \\boxed{0}."
    assert parse_vote(text) is None
    assert parse_vote(text + " The user moved on. \\boxed{1}") == 1
    assert parse_vote("Options: \\boxed{1}/\\boxed{-1}. Decision \\boxed{-1}") == -1


def test_echoed_examples_section_is_ignored_where_it_matters():
    # The judge copies the prompt's examples section (whose last box is \boxed{0}) after its
    # verdict; rule (a) drops the whole section, so the verdict stands.
    echoed = PRM_SYSTEM[PRM_SYSTEM.index(EXAMPLES_START):]
    assert echoed.endswith(EXAMPLES_END)
    text = "The user asked to redo it. \\boxed{-1}\n\nFor reference:\n" + echoed
    assert parse_vote(text) == -1
    # The example lines alone (without the markers) are still glosses: ignored too.
    lines = echoed.split("\n")[1:-1]
    assert parse_vote("Verdict \\boxed{-1}\n" + "\n".join(lines)) == -1


def test_a_bare_quoted_example_cannot_be_told_apart_so_the_last_box_wins():
    # "\boxed{1}." after the verdict has no gloss and no enumeration: it counts, and wins.
    text = "Verdict: \\boxed{-1}. Remember the format is \\boxed{1}."
    assert parse_vote(text) == 1


# ---------------------------------------------------------------------------- aggregate
@pytest.mark.parametrize("votes, score, failures", [
    ([1, None, None], 1, 2),     # the only valid vote decides
    ([1, -1, None], 0, 1),       # a tie of valid votes: 0
    ([1, 1, -1], 1, 0),          # majority
    ([0, 0, 1], 0, 0),
    ([None, None, None], 0, 3),
    ([1, 0, -1], 0, 0),          # three-way tie
    ([-1, -1, 1], -1, 0),
    ([1, 1, 0, -1], 1, 0),       # plurality, no tie
    ([], 0, 0),
])
def test_majority_of_valid_votes(votes, score, failures):
    result = aggregate(votes)
    assert result.score == score
    assert result.parse_failures == failures
    assert result.votes == [v for v in votes if v is not None]


def test_aggregate_rejects_out_of_range_votes():
    with pytest.raises(ValueError):
        aggregate([2, 1])


def test_tally_parses_and_keeps_raw_outputs():
    outputs = ["ok \\boxed{1}", "I cannot decide", "\\boxed{ +1.0 }"]
    result = tally(outputs)
    assert (result.score, result.votes, result.parse_failures) == (1, [1, 1], 1)
    assert result.raw == outputs


# ---------------------------------------------------------------------------- hints
def test_hint_vote_parses_vote_and_last_hint():
    text = ("Thinking [HINT_START]draft[HINT_END] ... \\boxed{1}\n"
            "[HINT_START]  Use kilometres, not miles.  [HINT_END]")
    assert parse_hint_vote(text) == (1, "Use kilometres, not miles.")


def test_hint_vote_missing_empty_or_unterminated_hint():
    assert parse_hint_vote("\\boxed{-1}") == (-1, None)
    assert parse_hint_vote("\\boxed{1} [HINT_START]   [HINT_END]") == (1, None)
    assert parse_hint_vote("\\boxed{1} [HINT_START]never closed") == (1, None)
    assert parse_hint_vote("no verdict") == (None, None)


def test_hint_is_cut_to_max_chars():
    vote, hint = parse_hint_vote("\\boxed{1}[HINT_START]" + "word " * 100 + "[HINT_END]",
                                 max_chars=20)
    assert vote == 1 and hint is not None and len(hint) <= 20 and hint.startswith("word word")


def test_box_inside_a_hint_does_not_count_and_echoed_opd_examples_are_ignored():
    assert parse_hint_vote("\\boxed{-1} [HINT_START]say \\boxed{1}[HINT_END]")[0] == -1
    echoed = OPD_SYSTEM[OPD_SYSTEM.index(EXAMPLES_START):]
    vote, hint = parse_hint_vote("\\boxed{1}[HINT_START]Ask first.[HINT_END]\n" + echoed)
    assert (vote, hint) == (1, "Ask first.")
    vote, hint = parse_hint_vote("Nothing learned.\n\\boxed{-1}\n" + echoed)
    assert (vote, hint) == (-1, None)


# ---------------------------------------------------------------------------- select_hint
def test_select_hint_needs_min_agree_positive_votes_with_hints():
    parsed = [(1, "Use kilometres."), (-1, "Use miles."), (1, None), (None, "x")]
    assert select_hint(parsed, min_agree=2) is None
    assert select_hint(parsed, min_agree=1) == "Use kilometres."
    assert select_hint([], min_agree=1) is None


def test_select_hint_picks_the_medoid_not_the_longest():
    a = "Answer in kilometres."
    b = "Answer in kilometres and round it."
    c = "Answer in kilometres and round it to one decimal place please thanks."
    # mean Jaccard: a 0.375, b 0.5, c 0.375 → b, neither the shortest nor the longest
    for order in ([a, b, c], [c, b, a], [b, a, c]):
        assert select_hint([(1, h) for h in order], min_agree=2) == b
    outlier = "Always think about whether the user wants a completely different unit system."
    assert select_hint([(1, outlier), (1, a), (1, b), (-1, c)], min_agree=2) in (a, b)


def test_select_hint_tie_breaks_by_shorter():
    assert select_hint([(1, "alpha beta gamma"), (1, "delta")], min_agree=2) == "delta"


# ---------------------------------------------------------------------------- inject_hint
EPHEMERAL = {"role": "user", "content": [{"type": "text", "text":
             "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nstuff\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"}]}


def test_inject_hint_appends_to_last_user_message_without_mutating():
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "second"}]
    out = inject_hint(messages, "Be brief.")
    assert out[3]["content"] == f"second\n\n{HINT_HEADER}\nBe brief."
    assert out[1]["content"] == "first"
    assert messages[3]["content"] == "second"


def test_inject_hint_skips_trailing_ephemeral_context():
    assert is_ephemeral_context(EPHEMERAL)
    assert is_ephemeral_context({"role": "user",
                                 "content": "  <<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"})
    assert not is_ephemeral_context({"role": "user", "content": "hello"})
    messages = [{"role": "user", "content": "list files"}, EPHEMERAL]
    out = inject_hint(messages, "Use ls -la.")
    assert out[0]["content"].endswith("Use ls -la.")
    assert out[1] == EPHEMERAL


def test_inject_hint_with_tool_result_tail_goes_to_the_user_message_before_it():
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    messages = [{"role": "user", "content": "list files"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}, EPHEMERAL]
    out = inject_hint(messages, "Include hidden files.")
    assert out[0]["content"] == f"list files\n\n{HINT_HEADER}\nInclude hidden files."
    assert out[1:] == messages[1:]


def test_inject_hint_content_parts_and_empty_content():
    out = inject_hint([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "H")
    assert out[0]["content"][-1] == {"type": "text", "text": f"\n\n{HINT_HEADER}\nH"}
    out = inject_hint([{"role": "user", "content": None}], "H")
    assert out[0]["content"] == f"{HINT_HEADER}\nH"


def test_inject_hint_without_user_message_is_an_error():
    with pytest.raises(ValueError, match="no user message"):
        inject_hint([{"role": "system", "content": "s"}, EPHEMERAL], "H")


