"""The ledger of held-out evaluations: lines only appended, the first run of each seed is the
reported one and later runs are listed beside it, never in its place."""

from __future__ import annotations

import json
import os

import pytest

from clawray import ledger


def test_the_suite_never_writes_the_repository_ledger():
    assert ledger.ledger_path() == ledger.Path(os.environ[ledger.LEDGER_ENV])
    assert "docs/results" not in str(ledger.ledger_path())


def test_lines_are_appended_with_commit_command_and_fields(tmp_path):
    path = tmp_path / "l.jsonl"
    a = ledger.record("demo", "keyword-judge/none", 0, "test", "satisfaction_after", 0.7, n=150,
                      command="clawray demo --seeds 0", path=path, iterations=40)
    ledger.record("demo", "keyword-judge/none", 0, "test", "satisfaction_after", 0.5, n=150,
                  command="clawray demo --seeds 0", path=path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == a and len(lines) == 2 and lines[1]["value"] == 0.5
    assert a["commit"] is None or len(a["commit"].split("+")[0]) == 12
    assert a["iterations"] == 40 and a["time"].endswith("+00:00")
    assert ledger.read(path) == lines and ledger.read(tmp_path / "none.jsonl") == []
    with pytest.raises(ValueError, match="arm must be a non-empty string"):
        ledger.record("demo", "", 0, "test", "m", 1.0, path=path)


def test_the_first_run_of_each_seed_is_reported_and_later_runs_are_listed(tmp_path):
    path = tmp_path / "l.jsonl"
    for seed, value in ((0, 0.30), (1, 0.10), (0, 0.90), (2, 0.20)):  # seed 0 run twice
        ledger.record("demo", "arm", seed, "test", "rise", value, path=path)
    ledger.record("demo", "arm", 3, "validation", "rise", 0.99, path=path)  # another pool
    (cell,) = ledger.first_runs(ledger.read(path)).values()
    assert cell["seeds"] == [0, 1, 2]
    assert cell["stats"]["mean"] == pytest.approx(0.2)  # 0.30, 0.10, 0.20: not the rerun's 0.90
    assert [x["value"] for x in cell["later"]] == [0.9]
    table = ledger.table(ledger.read(path))
    assert "| demo | arm | rise | 3 | 0.200 ± 0.058 (0.100 – 0.300) | 1 |" in table
    # a run marked invalid (it did not measure what its arm says) counts nowhere, and the
    # next run of its seed is that seed's first
    ledger.record("demo", "arm", 4, "test", "rise", 0.5, path=path, invalid="control not applied")
    ledger.record("demo", "arm", 4, "test", "rise", 0.3, path=path)
    (cell,) = ledger.first_runs(ledger.read(path)).values()
    assert cell["first"][4]["value"] == 0.3 and len(cell["later"]) == 1


def test_clawray_ledger_prints_the_table_and_says_when_there_is_none(tmp_path, capsys):
    from clawray.apps.cli import main

    path = tmp_path / "l.jsonl"
    assert main(["ledger", "--path", str(path)]) == 2
    assert "holds no evaluation yet" in capsys.readouterr().err
    ledger.record("demo", "arm", 0, "test", "rise", 0.25, path=path)
    assert main(["ledger", "--path", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 evaluations" in out and "| demo | arm | rise | 1 | 0.250 (0.250 – 0.250) | 0 |" in out


def test_before_after_lines_hold_only_what_was_measured_and_are_recorded_as_given(tmp_path):
    common = {"experiment": "x", "arm": "a", "seed": 1, "pool": "validation", "n": 10}
    lines = ledger.before_after("rate", 0.25, 0.5, steps=3, **common)
    assert [(x["metric"], x["value"]) for x in lines] == [
        ("rate_before", 0.25), ("rate_after", 0.5), ("rate_change", 0.25)]
    assert all(x["steps"] == 3 and x["n"] == 10 for x in lines)
    assert [x["metric"] for x in ledger.before_after("rate", 0.25, 0.5, record_before=False,
                                                     **common)] == ["rate_after", "rate_change"]
    assert [x["metric"] for x in ledger.before_after("rate", None, 0.5, **common)] == [
        "rate_after"]  # no before measured: no before, no change
    assert ledger.before_after("rate", 0.25, None, record_before=False, **common) == []
    path = tmp_path / "l.jsonl"
    written = ledger.record_lines(lines, path=path, command="clawray x")
    assert ledger.read(path) == written and written[2]["command"] == "clawray x"
    assert written[2]["pool"] == "validation" and written[2]["steps"] == 3


def _before_after(path, experiment, arm, seed, before, after):
    for line in ledger.before_after("satisfaction", before, after, experiment=experiment,
                                    arm=arm, seed=seed, pool="test"):
        ledger.record(**line, path=path)


def _headline_rows(path, experiment, rises, before):
    """The headline's rows of ``experiment`` whose arms rose by ``rises`` (arm: per seed)."""
    for arm, values in rises.items():
        for seed, rise in enumerate(values):
            _before_after(path, experiment, arm, seed, before, before + rise)
    return ledger.headline(ledger.read(path), {experiment: "e"}).splitlines()[2:]


def test_the_headline_pairs_each_control_with_the_trained_arm_by_seed(tmp_path):
    path = tmp_path / "l.jsonl"
    rises = {"j/none": [0.5, 0.6, 0.4], "j/shuffled_feedback": [0.1, 0.0, 0.05]}
    for arm, values in rises.items():
        for seed, rise in enumerate(values):
            _before_after(path, "exp", arm, seed, 0.2, 0.2 + rise)
    _before_after(path, "exp", "j/none", 0, 0.2, 0.2)  # a later run: listed, not in the table
    _before_after(path, "other", "j/none", 0, 0.1, 0.9)  # not a headline experiment
    table = ledger.headline(ledger.read(path), {"exp": "the experiment"})
    rows = table.splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| the experiment | j/none | 3 | 20.0% | 70.0% |")
    assert "+50.0 ± 5.8 | — |" in rows[0]  # the trained arm first, no pairing of its own
    # differences 0.40, 0.60, 0.35: mean 0.45, s.e. 0.076, t = 5.9 on 2 degrees of freedom
    assert rows[1] == ("| the experiment | j/shuffled_feedback | 3 | 20.0% | 25.0% | +5.0 ± 2.9 "
                       "| +45.0 ± 7.6 (p = 0.0276, shown) |")


def test_a_control_that_learned_as_much_is_not_shown(tmp_path):
    path = tmp_path / "l.jsonl"
    for seed, (trained, control) in enumerate(((0.5, 0.45), (0.3, 0.4), (0.4, 0.35))):
        _before_after(path, "exp", "j/none", seed, 0.2, 0.2 + trained)
        _before_after(path, "exp", "j/shuffled_feedback", seed, 0.2, 0.2 + control)
    row = ledger.headline(ledger.read(path), {"exp": "e"}).splitlines()[-1]
    assert "not shown" in row


def test_the_readme_table_is_the_ledgers():
    """README.md's "Results on the ledger" block is ``clawray ledger --headline`` of the
    repository's ledger: a figure changed in one place only fails here."""
    repo = ledger.Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    start, end = "<!-- ledger:headline -->\n", "\n<!-- /ledger:headline -->"
    block = readme[readme.index(start) + len(start):readme.index(end)]
    assert block == ledger.headline(ledger.read(repo / "docs" / "results" / "ledger.jsonl"))


def test_groups_of_users_pair_each_mode_with_the_trained_mode_within_the_group(tmp_path,
                                                                              monkeypatch):
    path = tmp_path / "l.jsonl"
    monkeypatch.setitem(ledger.TRAINED_MODE, "pu", "per_user")
    rises = {"per_user/brief": [0.3, 0.2, 0.25], "per_user_shuffled/brief": [0.0, 0.05, 0.0],
             "per_user/detailed": [0.1, 0.1, 0.05], "per_user_shuffled/detailed": [0.1, 0.0, 0.0],
             "shared/brief": [-0.1]}  # one seed: no pairing
    rows = _headline_rows(path, "pu", rises, 0.1)
    assert [r.split(" | ")[1] for r in rows] == [
        "per_user/brief", "per_user_shuffled/brief", "shared/brief", "per_user/detailed",
        "per_user_shuffled/detailed"]
    assert rows[0].endswith("| — |") and rows[3].endswith("| — |")  # the trained arms
    # brief: differences 0.30, 0.15, 0.25 against the control
    assert "| +23.3 ± 4.4 (p = 0.0339, shown) |" in rows[1]
    assert rows[2].endswith("| — |")  # a single seed cannot be paired
    assert "not shown" in rows[4]  # detailed: 0.0, 0.1, 0.05


def test_two_judges_in_one_experiment_pair_each_control_with_its_own_judges_trained_arm(
        tmp_path):
    path = tmp_path / "l.jsonl"
    rises = {"keyword/none": [0.7, 0.7, 0.7], "keyword/shuffled_feedback": [0.0, 0.1, 0.0],
             "keyword/no_training": [0.0, 0.0, 0.0],  # sorts before "none": still after it
             "model/none": [0.3, 0.4, 0.5], "model/shuffled_feedback": [0.0, 0.0, 0.1],
             "model/reply_hidden": [0.3, 0.3, 0.3]}
    rows = _headline_rows(path, "exp", rises, 0.2)
    assert [r.split(" | ")[1] for r in rows] == [
        "keyword/none", "keyword/no_training", "keyword/shuffled_feedback", "model/none",
        "model/reply_hidden", "model/shuffled_feedback"]
    assert rows[0].endswith("| — |") and rows[3].endswith("| — |")  # each judge's trained arm
    # keyword: differences 0.7, 0.6, 0.7 against its own trained arm, not the model judge's
    assert "| +66.7 ± 3.3 (p = 0.00" in rows[2]
    # model: differences 0.3, 0.4, 0.4 against the shuffled control
    assert "| +36.7 ± 3.3 (p = 0.00" in rows[5]
