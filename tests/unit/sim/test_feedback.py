"""Feedback phrasing pools and the judge model's examples: disjoint wording per split, labels
that follow the preference, and the heuristic judge measured on wording it was not tuned to."""

from __future__ import annotations

import collections
import random

import pytest

from clawray.sim.feedback import PHRASING_NAMES, PHRASINGS, REASONS, familiar, react
from clawray.sim.preferences import BriefReplies
from clawray.sim.judge_sft import (SPLITS, draw_reply, heuristic_accuracy, judge_examples,
                                        label_metrics, reason_of)


def test_phrasing_pools_share_no_frame_no_closer_and_no_reaction():
    names = list(PHRASINGS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = PHRASINGS[a], PHRASINGS[b]
            assert not set(pa.frames) & set(pb.frames), (a, b)
            for part in ("positive_closers", "negative_closers"):
                assert not set(getattr(pa, part)) & set(getattr(pb, part)), (a, b, part)
            said = {name: {react(name, ok, r, random.Random(k)) for k in range(300)
                           for ok in (True, False) for r in REASONS} for name in (a, b)}
            assert not said[a] & said[b], (a, b)
    with pytest.raises(ValueError, match="unknown phrasing pool"):
        react("casual", True, "long", random.Random(0))


def test_familiar_means_every_sentiment_word_was_in_the_training_wording():
    assert familiar("users", "Cool - I like that!!", True)  # both in judge_train
    assert not familiar("users", "Wonderful - I like that!!", True)  # a new opener
    assert not familiar("users", "Hold on: that rambles on...", False)
    shares = [familiar("users", react("users", ok, "long", random.Random(k)), ok)
              for k in range(400) for ok in (True, False)]
    assert 0.1 < sum(shares) / len(shares) < 0.6  # both kinds are well represented


def test_judge_splits_use_disjoint_wording_and_prompts():
    assert [SPLITS[s][0] for s in ("train", "validation", "test")] == \
        ["judge_train", "judge_validation", "users"]
    assert set(PHRASING_NAMES) == {"judge_train", "judge_validation", "users", "keywords"}
    assert [SPLITS[s][1] for s in ("train", "validation", "test")] == \
        ["train", "validation", "test"]
    texts = {s: {e.ctx.next_state[0]["content"] for e in judge_examples(400, s)}
             for s in SPLITS}
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]


def test_examples_are_balanced_and_labelled_by_the_preference():
    pref = BriefReplies()
    examples = judge_examples(600, "train", seed=1)
    counts = collections.Counter(e.label for e in examples)
    assert 0.12 < counts[0] / 600 < 0.28 and abs(counts[1] - counts[-1]) < 80
    for e in examples:
        if e.label:
            assert pref.satisfied(e.ctx.response_text) == (e.label == 1)
    rng = random.Random(0)
    assert {reason_of(draw_reply(rng, False)) for _ in range(200)} == set(REASONS) - {"short"}
    assert judge_examples(5, "test", seed=2)[0].ctx == judge_examples(5, "test", seed=2)[0].ctx


def test_label_metrics_counts_majorities_per_label():
    m = label_metrics([1, 1, -1, -1, 0], [[1, 1, -1], [None, -1, -1], [-1, None, None],
                                          [1, -1, None], [0, 0, 0]])
    assert (m["p_plus"], m["p_minus"], m["p_zero"]) == (0.5, 0.5, 1.0)  # [1,-1]: a tie, a miss
    assert m["balanced_acc"] == pytest.approx(2 / 3) and m["balanced_acc_pm"] == 0.5
    assert m["unparseable"] == pytest.approx(4 / 15)


def test_the_heuristic_judge_is_not_tuned_to_the_users_wording():
    # Measured, not assumed: the keyword judge mostly hears no feedback in the users' words
    # (the judge model is what reads them; clawray judge-sft reports both).
    m = heuristic_accuracy(judge_examples(300, "test"))
    assert m["p_zero"] == 1.0 and m["balanced_acc_pm"] < 0.5


def test_the_keywords_pool_is_what_the_heuristic_judge_reads():
    # Protocol tests and the quickstart run the loop with the heuristic judge: their users
    # speak its keywords, and it reads every reaction as meant.
    m = heuristic_accuracy([e for e in _keyword_examples()])
    assert m["p_plus"] == m["p_minus"] == m["p_zero"] == 1.0


def _keyword_examples():
    from clawray.judging.prompts import TurnContext
    from clawray.sim.judge_sft import JudgeExample

    rng = random.Random(3)
    for i in range(300):
        ok, reason = i % 2 == 0, REASONS[i % 3]
        said = react("keywords", ok, reason, rng)
        yield JudgeExample(TurnContext([], [], "x", [], [{"role": "user", "content": said}]),
                           1 if ok else -1)
    yield JudgeExample(TurnContext([], [], "x", [], [{"role": "user", "content": "Hi!"}]), 0)


def test_judge_builds_aggregate_per_seed_figures_with_standard_errors():
    from clawray.sim.judge_sft import FIGURES, aggregate_builds

    def info(seed, pm):
        fig = {f: 0.5 for f in FIGURES} | {"balanced_acc_pm": pm}
        return {"seed": seed, "key": f"k{seed}", "train_s": 10.0, "recipe": "2", "n_train": 40,
                "steps": 4, "batch_size": 2, "lr": 1e-3, "n_eval": 9, "m": 3,
                "eval_temperature": 0.6, "validation": {"judge": fig, "heuristic": {}},
                "test": {"judge": fig | {"p_plus": seed / 10}}}

    agg = aggregate_builds([info(0, 0.6), info(1, 0.8), info(2, 0.7)])
    assert agg["builds"] == 3 and [s["key"] for s in agg["seeds"]] == ["k0", "k1", "k2"]
    pm = agg["test"]["balanced_acc_pm"]
    assert pm["mean"] == pytest.approx(0.7) and pm["min"] == pytest.approx(0.6)
    assert pm["stderr"] == pytest.approx(0.1 / 3 ** 0.5)  # sd 0.1 (n - 1), over sqrt(3)
    assert agg["test"]["p_plus"]["mean"] == pytest.approx(0.1)
    assert agg["settings"]["steps"] == 4
    assert aggregate_builds([info(0, 0.6)])["test"]["balanced_acc_pm"]["stderr"] is None
