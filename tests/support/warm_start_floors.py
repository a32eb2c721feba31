"""The warm starts whose floors tests/cpu/training/test_warm_start_floors_on_cpu.py checks:
the policy (env-demo's former SFT recipe, 200 steps) and the step RM trained on that
policy's steps.

tests/conftest.py builds them in the background at the lowest CPU priority from the session's
first test on (``python -m tests.support.warm_start_floors CACHE_DIR``), so the minutes of SFT
overlap the tests that mostly wait on Ray; the floor tests then call the same functions on the
same cache folder and get the cached results (or build them, where no build ran).
"""

from __future__ import annotations

import sys
from typing import Any

from clawray.config import ClawRayConfig

EVAL_TASKS = 100  # held-out validation-pool tasks the policy is scored on, one episode each
EVAL_TEMPERATURE = 0.5  # their sampling temperature (why: the test module's doc)
# Train-pool tasks whose policy steps the RM learns from. 60 tasks (100 steps) separated the
# steps of one policy build (0.783) but not of two others (0.527, 0.518): docs/rlanything.md.
RM_TASKS = 100
RM_EVAL_TASKS = 20  # test-pool tasks whose policy steps score the RM (30 validation-pool
# tasks' steps choose its step: rm_sft.run_rm_sft's defaults)


def policy_config(cache_dir: str) -> ClawRayConfig:
    """env-demo's warm-start recipe as it was until 2026-12-07 (600 expert tasks at <= 0.3 of
    the box, 200 steps of 32 rows, lr 1e-3, seed 0; env-demo's now trains 600 steps and keeps
    the checkpoint that plays best on validation tasks, ~4x the build: too long to overlap the
    suite), scored on ``EVAL_TASKS`` held-out tasks."""
    return (ClawRayConfig().inference(engine="hf")
            .environments(family="household", history_window=0)
            .sft(tasks=600, steps=200, batch_size=32, lr=1e-3, max_difficulty=0.3,
                 eval_tasks=EVAL_TASKS, eval_temperature=EVAL_TEMPERATURE,
                 cache_dir=cache_dir, seed=0))


def rm_config(policy_cfg: ClawRayConfig) -> ClawRayConfig:
    """The RM's warm start: up to 200 steps of 16 rows (stopped early on the validation pool);
    scored with m = 3 votes."""
    return policy_cfg.copy_with(sft={"steps": 200, "batch_size": 16, "lr": 1e-3,
                                     "eval_tasks": RM_EVAL_TASKS})


def one_thread() -> Any:
    """Build and score on one torch thread, as judge-sft does: the same recipe built on one
    thread and on two gives different models (and different RMs on their steps), so a floor
    measured alone holds for the suite's build only when both use the same count."""
    from clawray.training.sft import torch_threads

    return torch_threads(1)


def policy(cache_dir: str) -> Any:
    from clawray.training.sft import run_sft

    with one_thread():
        return run_sft(policy_config(cache_dir), progress=False)


def rm(cache_dir: str, policy_path: str) -> Any:
    from clawray.training.rm_sft import run_rm_sft

    with one_thread():
        return run_rm_sft(rm_config(policy_config(cache_dir)), policy_path, n_tasks=RM_TASKS,
                          max_difficulty=0.3, progress=False)


def main(argv: list[str]) -> int:
    """Build the warm starts into ``CACHE_DIR``: the policy, then the RM on its steps."""
    [cache_dir] = argv
    built = policy(cache_dir)
    print(f"policy: {built.path} (held-out success {built.info['success_before']:.3f} -> "
          f"{built.info['success_after']:.3f})", flush=True)
    scored = rm(cache_dir, str(built.path)).info["rm_after"]
    print(f"RM: held-out balanced accuracy {scored['balanced_acc']}", flush=True)
    print("warm starts ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
