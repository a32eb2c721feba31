"""A floor on learning: the SFT warm start (recipe of ``clawray env-demo``) raises held-out
household success, scored on tasks of the validation pool that no demonstration comes from."""

from __future__ import annotations

from clawray.config import ClawRayConfig

FLOOR = 0.10  # success after SFT must beat the untrained model's by this much (40 tasks)


def test_sft_raises_held_out_success_above_a_floor(tmp_path):
    from clawray.training.sft import run_sft

    cfg = (ClawRayConfig()
           .environments(family="household", history_window=0)
           .sft(tasks=600, steps=200, batch_size=32, lr=1e-3, max_difficulty=0.3,
                eval_tasks=40, cache_dir=str(tmp_path / "sft"), seed=0))
    info = run_sft(cfg, progress=False).info
    assert info["eval_tasks"] == 40
    assert info["nll_last"] < 0.5 * info["nll_first"]
    print(f"SFT floor: held-out success {info['success_before']:.3f} -> "
          f"{info['success_after']:.3f} ({info['train_s']:.0f} s)")
    assert info["success_after"] >= info["success_before"] + FLOOR, info
