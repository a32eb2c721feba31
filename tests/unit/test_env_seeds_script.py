"""``scripts/env_seeds.py``: env-demo arms compared seed by seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.common import load_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "env_seeds.py"


@pytest.fixture(scope="module")
def env_seeds():
    return load_file(SCRIPT, "env_seeds")


def run(folder: Path, seed: int, curve: list[float]) -> Path:
    evals = [{"iteration": 10 * i, "success": s, "stderr": 0.03, "n": 200}
             for i, s in enumerate(curve)]
    folder.mkdir(parents=True)
    (folder / "env_summary.json").write_text(json.dumps(
        {"seed": seed, "evals": evals, "before": evals[0], "after": evals[-1]}))
    return folder


def test_arms_are_paired_on_the_seeds_both_ran_and_a_seed_counts_once(env_seeds, tmp_path):
    earlier = tmp_path / "env_seeds.json"  # the format `clawray env-demo --seeds` writes
    earlier.write_text(json.dumps({"seeds": [
        {"seed": 0, "before": 0.1, "after": 0.2, "rise": 0.1, "n": 200, "curve": []},
        {"seed": 1, "before": 0.1, "after": 0.3, "rise": 0.2, "n": 200, "curve": []}]}))
    a = env_seeds.arm([earlier, run(tmp_path / "a2", 2, [0.1, 0.2, 0.25])])
    b = env_seeds.arm([run(tmp_path / f"b{s}", s, [0.1, 0.1, 0.1 + r])
                       for s, r in ((2, 0.05), (0, 0.04), (3, 0.3))])
    assert [r["seed"] for r in a["seeds"]] == [0, 1, 2] and a["rise_mean"] == pytest.approx(0.15)
    d = env_seeds.paired(a, b)  # b minus a on seeds 0 and 2; seed 1 (a) and 3 (b) left out
    assert d["seeds"] == [0, 2]
    assert d["differences"] == pytest.approx([-0.06, -0.1]) and d["mean"] == pytest.approx(-0.08)
    assert d["stderr"] == pytest.approx(0.02) and 0.1 < d["ttest_p"] < 0.2  # t = -4, 1 d.f.
    with pytest.raises(SystemExit, match="seed appears twice"):
        env_seeds.arm([earlier, run(tmp_path / "again", 1, [0.1, 0.2])])
