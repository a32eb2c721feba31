r"""A synthetic step judge built on the environment's step oracle, with chosen error rates.

``OracleJudge(p_plus, p_minus)`` answers a step-RM request (``steps.step_rm_request``) the way
Theorem 1 of RLAnything models a reward model: for a step the oracle marks as progress it
writes ``\boxed{1}`` with probability ``p_plus``, for any other step ``\boxed{-1}`` with
probability ``p_minus``, each scoring independently. Draws are keyed by the prompt and the
scoring index (a SHA-256 of both), so the same step gets the same scores in any order and on any
machine.

It is a function judge (``rlanything.rm_backend: function``), for tests and for runs that
isolate the policy side of RLAnything from RM quality; ``p_plus = p_minus = 1`` is the oracle.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


class OracleJudge:
    def __init__(self, p_plus: float = 1.0, p_minus: float = 1.0, salt: str = "") -> None:
        for name, p in (("p_plus", p_plus), ("p_minus", p_minus)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        self.p_plus, self.p_minus, self.salt = p_plus, p_minus, salt

    def _uniform(self, messages: list[dict[str, Any]], j: int) -> float:
        key = json.dumps([self.salt, messages, j], sort_keys=True).encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64

    def __call__(self, request: Any, n: int, temperature: float) -> list[str]:
        ctx = getattr(request, "context", None)
        if not hasattr(ctx, "progress"):
            raise ValueError("the oracle judge scores step-RM requests only (a request whose "
                             "context is a rlanything.steps.StepContext)")
        out = []
        for j in range(n):
            right = self._uniform(request.messages, j) < (
                self.p_plus if ctx.progress else self.p_minus)
            score = (1 if ctx.progress else -1) * (1 if right else -1)
            out.append(f"oracle: \\boxed{{{score}}}")
        return out


oracle_step_judge = OracleJudge()
noisy_step_judge = OracleJudge(0.8, 0.8)
