"""RLAnything: the policy, a step-wise reward model and the environment co-evolving
(REFERENCE §5). ``core`` holds the rules as pure functions (no Ray, no torch); the step-wise RM
prompt lives in ``clawray.judging.step_rm``.
"""

from clawray.rlanything.core import (
    POLICY_BAND,
    RM_BAND,
    accept_candidate,
    accuracy,
    adaptation_direction,
    failure_steps,
    in_band,
    policy_task_filter,
    precision_bound,
    programmatic_critique,
    rm_consistency_rewards,
    rm_task_filter,
    simulate_precision,
    step_advantages,
    step_rewards,
    trained_steps,
)

__all__ = [
    "POLICY_BAND",
    "RM_BAND",
    "accept_candidate",
    "accuracy",
    "adaptation_direction",
    "failure_steps",
    "in_band",
    "policy_task_filter",
    "precision_bound",
    "programmatic_critique",
    "rm_consistency_rewards",
    "rm_task_filter",
    "simulate_precision",
    "step_advantages",
    "step_rewards",
    "trained_steps",
]
