"""RLAnything: the policy, a step-wise reward model and the environment co-evolving
(docs/rlanything.md).

- ``core``: the rules as pure functions (step rewards, advantages, RM consistency rewards,
  task bands, adaptation trigger and acceptance, Theorem 1's simulation); no Ray, no torch.
- ``steps``: a played episode cut into the steps the RM judges; ``oracle``: a synthetic RM.
- ``adapter``: the ``EnvAdapter`` actor (task slots, rewrites, acceptance).
- ``rm_trainer``: the ``RMCoTrainer`` actor (the RM's learner and weight channel).
- ``rm_sft``: the RM's warm start (``clawray rm-sft``).
- ``loop``: one synchronous step of ``training.mode: rlanything``.

The step-wise RM prompt lives in ``clawray.judging.step_rm``.
"""
