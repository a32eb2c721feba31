"""RLAnything: the policy, a step-wise reward model and the environment co-evolving
(docs/rlanything.md).

- ``core``: the rules as pure functions (step rewards, advantages, RM consistency rewards,
  task bands, adaptation trigger and acceptance, Theorem 1's simulation); no Ray, no torch.
- ``steps``: a played episode cut into the steps the RM judges; ``oracle``: a synthetic RM.
- ``env_adapter``: the environment adapter's core (task slots, rewrites, acceptance);
  ``env_adapter_actor``: the ``EnvAdapter`` actor.
- ``rm_cotrainer``: the ``RMCoTrainer`` actor (the RM's learner and weight channel).
- the RM's warm start (``clawray rm-sft``) is ``clawray.training.rm_sft``.
- ``loop``: one synchronous step of ``training.mode: rlanything``.

The step-wise RM prompt lives in ``clawray.judging.step_rm``.
"""
