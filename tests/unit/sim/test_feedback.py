"""Feedback phrasing pools and the judge model's examples: disjoint wording per split (to the
word between training and test), labels that only the user's words give (no rule that reads
the reply alone beats chance), and the heuristic judge measured on wording it was not tuned
to."""

from __future__ import annotations

import collections
import random

import pytest

from clawray.judging.rules import classify_next_state
from clawray.sim.feedback import FUNCTION_WORDS, PHRASING_NAMES, PHRASINGS, REASONS, react
from clawray.sim.judge_sft import (EVAL_SPLITS, SPLITS, USER_PREFERENCES, draw_reply, heuristic_accuracy,
                                   judge_examples, label_metrics, reply_rule_accuracy)
from clawray.sim.preferences import BriefReplies, DetailedReplies


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


def test_the_judge_is_tested_on_wording_that_shares_no_part_and_no_word_with_its_training():
    train = PHRASINGS["judge_train"]
    for held_out in ("judge_validation", "users"):
        other = PHRASINGS[held_out]
        assert not train.parts() & other.parts(), held_out
        assert not train.words() & other.words(), (held_out, train.words() & other.words())
        assert other.parts() and len(other.words()) > 30
    # the check reads words, not parts: a shared word in new surroundings is caught
    assert "cool" in train.words() and "that's" in FUNCTION_WORDS
    assert not {"too", "long", "short", "more", "no"} & FUNCTION_WORDS
    # and no part of the judge pools is a keyword of the heuristic judge
    for name in ("judge_train", "judge_validation", "users"):
        heard = [part for part in PHRASINGS[name].parts()
                 if classify_next_state([{"role": "user", "content": part}])[0]]
        assert not heard, (name, heard)
    assert classify_next_state([{"role": "user", "content": "Thanks a lot"}])[0] == 1


def test_judge_splits_use_disjoint_wording_and_prompts():
    assert [SPLITS[s][0] for s in ("train", "seen_wording", "validation", "test")] == \
        ["judge_train", "judge_train", "judge_validation", "users"]
    assert set(PHRASING_NAMES) == {"judge_train", "judge_validation", "users", "keywords"}
    assert [SPLITS[s][1] for s in ("train", "seen_wording", "validation", "test")] == \
        ["train", "validation", "validation", "test"]
    assert EVAL_SPLITS == ("seen_wording", "validation", "test")
    texts = {s: {e.ctx.next_state[0]["content"] for e in judge_examples(400, s)}
             for s in SPLITS}
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]
    requests = {s: {e.ctx.request[0]["content"] for e in judge_examples(400, s)}
                for s in SPLITS}
    assert not requests["train"] & requests["seen_wording"]  # new turns, the trained wording


def test_examples_are_balanced_and_labelled_by_what_the_user_says():
    examples = judge_examples(1200, "train", seed=1)
    counts = collections.Counter(e.label for e in examples)
    assert 0.12 < counts[0] / 1200 < 0.28 and abs(counts[1] - counts[-1]) < 120
    assert {e.preference for e in examples if e.label} == set(USER_PREFERENCES)
    for e in examples:
        if e.label:
            pref = USER_PREFERENCES[e.preference]()
            assert pref.satisfied(e.ctx.response_text) == (e.label == 1)
        else:
            assert e.preference == ""
    rng = random.Random(0)
    for brief in (True, False):
        for _ in range(100):
            text = draw_reply(rng, brief)
            assert BriefReplies().satisfied(text) == brief != DetailedReplies().satisfied(text)
    assert judge_examples(5, "test", seed=2)[0].ctx == judge_examples(5, "test", seed=2)[0].ctx


def test_no_rule_that_reads_only_the_reply_can_give_the_labels():
    """The label is what the user said, not something the reply shows: the two trivial rules
    (brief is good, detailed is good) and every threshold on the reply's word count score
    chance on the ±1 examples, and the same reply gets both labels."""
    examples = [e for e in judge_examples(2000, "train", seed=3) if e.label]
    rules = reply_rule_accuracy(examples)
    for name, m in rules.items():
        assert abs(m["balanced_acc_pm"] - 0.5) < 0.05, (name, m)
    labels = [e.label for e in examples]
    for k in range(1, 40):
        for sign in (1, -1):
            votes = [[sign if len(e.ctx.response_text.split()) <= k else -sign]
                     for e in examples]
            assert abs(label_metrics(labels, votes)["balanced_acc_pm"] - 0.5) < 0.06, (k, sign)
    by_reply = collections.defaultdict(set)
    for e in examples:
        by_reply[e.ctx.response_text].add(e.label)
    assert sum(len(v) == 2 for v in by_reply.values()) >= 3  # the canned replies, both ways
    # a label that did follow the reply (the recipe before this one) is caught by the check
    leaky = [1 if BriefReplies().satisfied(e.ctx.response_text) else -1 for e in examples]
    assert label_metrics(leaky, [[1 if BriefReplies().satisfied(e.ctx.response_text) else -1]
                                 for e in examples])["balanced_acc_pm"] == 1.0


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


def test_judge_builds_stand_beside_the_rules_that_read_only_the_reply(tmp_path):
    """``aggregate_builds``' ``beside``: the keyword judge, each reply-only rule and the base
    model over the builds, and the judge minus each build's better reply-only rule, paired
    by seed; ``plot_builds`` draws them."""
    from clawray.sim.judge_sft import FIGURES, aggregate_builds, plot_builds

    def info(seed, judge, brief, base=None):
        def m(v):
            return {f: v for f in FIGURES}
        split = {"judge": m(judge), "heuristic": m(0.0),
                 "reply_rules": {"brief_is_good": m(brief), "detailed_is_good": m(1 - brief)}}
        if base is not None:
            split["base"] = m(base)
        return {"seed": seed, "key": f"k{seed}", "train_s": 1.0, "recipe": "3", "n_train": 9,
                "steps": 2, "batch_size": 2, "lr": 1e-3, "n_eval": 9, "m": 3,
                "eval_temperature": 0.6, "lora_rank": 16, "test": split}

    agg = aggregate_builds([info(0, 0.9, 0.4), info(1, 0.8, 0.55), info(2, 0.85, 0.5)])
    side = agg["beside"]["test"]
    assert side["heuristic"]["mean"] == 0.0 and "base" not in side
    assert side["rule/brief_is_good"]["mean"] == pytest.approx((0.4 + 0.55 + 0.5) / 3)
    versus = side["judge_minus_best_reply_rule"]
    # the better rule per build: 0.6, 0.55, 0.5 -> differences 0.3, 0.25, 0.35
    assert versus["seeds"] == [0, 1, 2]
    assert versus["difference"]["mean"] == pytest.approx(0.3)
    assert versus["shown"] is True and versus["p_value"] < 0.05
    assert agg["settings"]["lora_rank"] == 16
    with_base = aggregate_builds([info(0, 0.8, 0.4, base=0.1), info(1, 0.7, 0.5, base=0.0)])
    assert with_base["beside"]["test"]["base"]["mean"] == pytest.approx(0.05)
    assert plot_builds(agg, tmp_path / "b.png").stat().st_size > 0


def test_a_judge_builds_held_out_figures_go_on_the_ledger_by_pool():
    """``ledger_lines``: the validation split is the validation pool, the test split the test
    pool, seen_wording is not a pool; the judge's figures beside the heuristic's and the
    reply-only rules'; a figure of a label with no example (None) writes no line."""
    from clawray.sim.judge_sft import FIGURES, ledger_lines

    def metrics(v):
        return {"n": 40, **{f: v for f in FIGURES}, "p_zero": None}

    def split(v):
        return {"judge": metrics(v), "heuristic": metrics(0.5),
                "reply_rules": {"brief_is_good": metrics(0.45), "detailed_is_good": metrics(0.55)}}

    info = {"recipe": "3", "n_train": 200, "steps": 3, "batch_size": 4, "lr": 5e-4, "m": 3,
            "eval_temperature": 0.6, "key": "k", "seed": 2, "lora_rank": 16, "threads": 2,
            "seen_wording": split(0.9), "validation": split(0.8), "test": split(0.7)}
    lines = ledger_lines(info, "smollm2-135m-instruct")
    assert {line["experiment"] for line in lines} == {"judge-sft-smollm2-135m-instruct"}
    assert {line["pool"] for line in lines} == {"validation", "test"}
    judge_test = {line["metric"]: line["value"] for line in lines
                  if line["arm"] == "judge" and line["pool"] == "test"}
    assert judge_test == {f: 0.7 for f in FIGURES if f != "p_zero"}
    assert {line["arm"] for line in lines} == {"judge", "heuristic", "rule/brief_is_good",
                                               "rule/detailed_is_good"}
    assert all(line["seed"] == 2 and line["lora_rank"] == 16 and line["n"] == 40
               for line in lines)
    assert {line["experiment"] for line in ledger_lines(info, "embedded")} == {"judge-sft"}
