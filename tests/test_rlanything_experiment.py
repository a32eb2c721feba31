"""``clawray rla-table`` (rlanything/experiment.py): the rows' settings, the summary over seeds
and the table, from hand-made run results (the runs themselves need minutes per step; their
numbers are in docs/rlanything.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawray.config import ClawRayConfig
from clawray.rlanything.experiment import (ROWS, plot_table, summarize, table_config,
                                           table_markdown)


def test_rows_switch_rm_cotraining_and_env_adaptation_and_share_the_rest(tmp_path):
    cfgs = {row: table_config(ClawRayConfig(), tmp_path, row, 3, "/p", "/rm") for row in ROWS}
    switches = {row: (c.rlanything_cfg.co_train_rm, c.rlanything_cfg.adapt_env)
                for row, c in cfgs.items()}
    assert switches == {"policy": (False, False), "policy+rm": (True, False),
                        "policy+rm+env": (True, True)}
    for row, c in cfgs.items():
        assert c.training_cfg.mode == "rlanything" and c.model_cfg.path == "/p"
        assert c.rlanything_cfg.rm_model_path == "/rm" and c.rlanything_cfg.rm_backend == "server"
        assert c.environments_cfg.seed == 3 and c.environments_cfg.family == "household"
        # Each row writes under its own folder: no row reads another's buffer or adapter.
        assert Path(c.buffer_cfg.path).parent == tmp_path / "seed3" / row.replace("+", "_")
    assert len({c.buffer_cfg.path for c in cfgs.values()}) == 3
    with pytest.raises(ValueError, match="unknown row 'rm-only'"):
        table_config(ClawRayConfig(), tmp_path, "rm-only", 0, "/p", "/rm")


def run(success: tuple[float, float], rm: tuple[float, float], accepted: list[int]) -> dict:
    def m(s: float, a: float) -> dict:
        return {"success": s, "rm": {"step_acc": a, "majority_acc": a + 0.05}}
    return {"before": m(success[0], rm[0]), "after": m(success[1], rm[1]),
            "steps": [{"step": i + 1, "env_accepted": n} for i, n in enumerate(accepted)],
            "accepted_total": sum(accepted)}


def test_summary_gives_mean_and_population_spread_over_seeds_and_a_table(tmp_path):
    runs = {"policy": {"0": run((0.2, 0.3), (0.7, 0.7), [0, 0]),
                       "1": run((0.2, 0.1), (0.7, 0.7), [0, 0])},
            "policy+rm+env": {"0": run((0.2, 0.4), (0.7, 0.8), [1, 2])}}
    s = summarize(runs, [0, 1], 2, 0.2, 10.0)
    p = s["rows"]["policy"]
    assert p["success_after"]["mean"] == pytest.approx(0.2)
    assert p["success_after"]["std"] == pytest.approx(0.1)  # population std of 0.3 and 0.1
    assert p["success_after"]["values"] == [0.3, 0.1] and p["seeds"] == ["0", "1"]
    e = s["rows"]["policy+rm+env"]
    assert e["accepted_rewrites"]["mean"] == 3 and e["success_after"]["n"] == 1
    assert e["rm_majority_acc_after"]["mean"] == pytest.approx(0.85)
    md = table_markdown(s)
    assert "| policy | 20.0 % ± 0.0 % | 20.0 % ± 10.0 % | 0.700 ± 0.000 |" in md
    assert "| policy+rm+env | 20.0 % | 40.0 % | 0.700 | 0.800 |" in md  # one seed: no ±
    plot_table(s, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_measure_nobody_could_take_is_a_dash_not_a_crash():
    none = {"success": 0.0, "rm": {"step_acc": None, "majority_acc": None}}
    runs = {"policy": {"0": {"before": none, "after": none, "steps": [], "accepted_total": 0}}}
    md = table_markdown(summarize(runs, [0], 0, 0.0, 0.0))
    assert "| policy | 0.0 % | 0.0 % | - | - | - | - | 0.000 |" in md
