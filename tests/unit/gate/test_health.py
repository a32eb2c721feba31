"""Health checks: what reads as text, empties, lengths, tool calls."""

import pytest

from clawray.gate.health import health, health_problems, readable

PROBLEMS = dict(min_readable=0.8, max_empty=0.2, max_length_ratio=3.0, max_broken_tool_calls=0.1)


@pytest.mark.parametrize("text, ok", [
    ("Hello! How can I help you today?", True),
    ("OK, I understand.", True),
    ('",",",",",",",",",",', False),  # the collapse the demo once produced
    ("", False),
    ("   ", False),
    ("the the the the the the the", False),  # one word repeated
    ("1234 5678 !!!", False),
    ('<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>', True),
    # what a random LoRA made of the embedded model say (tests/support/lora.random_lora)
    ("readfindprocesscheckcheckcheckcheckcheckcheckreadreadrun", False),  # glued words
    ("find</tool_call>find answers</tool_call>checkdreportcheck", False),  # stray markup
    ("calendarcheckfindcalendar model", False),
    ("answers youK!reportreport,,Hurlurl.searchododO.odreport", False),
    ("Good question. I am a small model, so my answers are short.", True),
    ("It's a well-known fact: 42 is 6*7, (mostly).", True),
    ("你好，我能帮你什么？", True),
    ("Sure. " + '<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>', True),
])
def test_readable(text, ok):
    assert readable(text) is ok


def test_health_measures_a_set_of_replies():
    texts = ["Hello there, friend.", "", '",",",",",",",",', "Fine, thanks.",
             '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>', "<tool_call>\n{broken"]
    h = health(texts, [4, 0, 9, 3, 12, 5])
    assert h.n == 6
    assert h.readable_rate == pytest.approx(3 / 6)  # a broken call is stray markup
    assert h.empty_rate == pytest.approx(1 / 6)
    assert h.median_tokens == 4.5
    assert h.tool_calls == 2 and h.tool_call_valid_rate == 0.5
    problems = health_problems(h, None, **PROBLEMS)
    assert any("readable replies 50%" in p for p in problems)
    assert h.broken_tool_call_rate == pytest.approx(1 / 6)
    assert any("replies with a tool call that does not parse 17%" in p for p in problems)
    assert not any("empty" in p for p in problems)  # 17% <= 20%


def test_readability_is_judged_against_the_reference_rate_on_the_same_set():
    code_heavy = health(["Run `x = f(y)` then"] * 6 + ["Done."] * 4, [6] * 10)
    assert code_heavy.readable_rate == 0.4
    ref = {"reference_readable": 0.4}
    assert health_problems(code_heavy, code_heavy, **PROBLEMS, **ref) == []  # as before
    worse = health(["Run `x = f(y)` then"] * 8 + ["Done."] * 2, [6] * 10)
    [problem] = health_problems(worse, code_heavy, **PROBLEMS, **ref)
    assert "readable replies 20%" in problem and "reference's 40%" in problem


def test_a_healthy_set_has_no_problems_and_bad_input_is_refused():
    h = health(["Good question. I am a small model."] * 5, [9] * 5)
    assert health_problems(h, h, **PROBLEMS) == []
    assert h.tool_call_valid_rate is None
    with pytest.raises(ValueError, match="2 texts but 1 token counts"):
        health(["a", "b"], [1])
    with pytest.raises(ValueError, match="empty"):
        health([], [])
