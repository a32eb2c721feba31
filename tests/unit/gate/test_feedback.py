"""The gate's shadow set scored by held-out explicit feedback (clawray/gate/feedback.py): rated
replies are read with precise errors, the scorer learns what the ratings say and nothing when
they say nothing, and it is reported next to the rules a cue alone gives."""

from __future__ import annotations

import json
import random

import pytest

from clawray.gate.feedback import FeedbackScorer, RatedReply, feedback_shadow_set, read_rated

WORDS = ("the light scatters off air molecules and blue scatters most of all so the sky looks "
         "blue to us during the day").split()


def rated(n: int = 60, seed: int = 0, signal: bool = True) -> list[RatedReply]:
    """Users who rate long replies up and short ones down (``signal``), or at random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        long = i % 2 == 0
        reply = " ".join(rng.choices(WORDS, k=rng.randint(12, 20) if long else rng.randint(2, 6)))
        up = long if signal else rng.random() < 0.5
        out.append(RatedReply([{"role": "user", "content": f"question {i % 25}"}], reply,
                              1 if up else -1))
    return out


def test_the_scorer_learns_what_the_ratings_say_and_reports_it_beside_the_trivial_rules():
    scorer = FeedbackScorer.fit(rated())
    long = "the light scatters off air molecules and blue scatters most so the sky looks blue"
    assert scorer.prob_up(long) > 0.8 > 0.2 > scorer.prob_up("blue sky")
    rep = scorer.report
    assert rep["n"] == 60 and rep["up"] == rep["down"] == 30 and rep["folds"] == 5
    assert rep["scorer"]["balanced_accuracy"] > 0.9
    assert rep["scorer"]["p_up"] > 0.8 and rep["scorer"]["p_down"] > 0.8
    assert rep["always_up"] == {"balanced_accuracy": 0.5, "p_up": 1.0, "p_down": 0.0}
    assert rep["length_only"]["balanced_accuracy"] > 0.9  # the cue here is length itself


def test_ratings_that_say_nothing_teach_nothing():
    accs = [FeedbackScorer.fit(rated(seed=s, signal=False), seed=s).report["scorer"]
            ["balanced_accuracy"] for s in range(5)]
    assert sum(accs) / len(accs) < 0.65, accs


def test_too_few_ratings_of_one_side_are_refused():
    few = [r for r in rated() if r.rating == 1] + [r for r in rated() if r.rating == -1][:3]
    with pytest.raises(ValueError, match="30 up and 3 down; a scorer needs at least 4 of each"):
        FeedbackScorer.fit(few)


@pytest.mark.parametrize("line,message", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected an object, got list"),
    ('{"messages": [], "reply": "x", "rating": "up"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "q"}], "rating": "up"}', "'reply' must be"),
    ('{"messages": [{"role": "user", "content": "q"}], "reply": "x", "rating": "meh"}',
     "'rating' must be 'up' or 'down' \\(or 1 / -1\\), got 'meh'"),
    ('{"messages": [{"role": "user", "content": "q"}], "reply": "x", "rating": true}',
     "'rating' must be .*, got True"),
])
def test_a_bad_line_is_named_with_what_is_wrong(tmp_path, line, message):
    path = tmp_path / "rated.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "q"}], "reply": "x", '
                    '"rating": -1}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"rated.jsonl:2: {message}"):
        read_rated(path)
    with pytest.raises(ValueError, match="no file"):
        read_rated(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no ratings"):
        read_rated(tmp_path / "empty.jsonl")


def test_the_shadow_set_asks_each_rated_prompt_once_and_scores_by_the_fitted_scorer(tmp_path):
    path = tmp_path / "rated.jsonl"
    path.write_text("".join(json.dumps({"messages": r.messages, "reply": r.reply,
                                        "rating": "up" if r.rating == 1 else "down"}) + "\n"
                            for r in rated()))
    shadow = feedback_shadow_set(str(path), n=10)
    assert [m[0]["content"] for m in shadow.prompts] == [f"question {i}" for i in range(10)]
    assert len(feedback_shadow_set(str(path), n=None).prompts) == 25  # distinct prompts
    long = "the light scatters off air molecules and blue scatters most so the sky looks blue"
    assert shadow.score(0, long) > 0.8 > 0.2 > shadow.score(0, "blue sky")
    assert "60 ratings, 10 prompts, scorer balanced accuracy" in shadow.name
