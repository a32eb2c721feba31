"""Judging turns: PRM and OPD-hint prompts, ``\\boxed{}`` parsing, vote aggregation, judge
backends (a Python function, an OpenAI-compatible URL, a ``JudgeServer`` deployment) and the
OPD helpers (hint choice, hint injection, teacher-minus-rollout token advantages).

Import the submodules directly; this package imports nothing heavy.
"""
