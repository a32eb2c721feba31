"""Which users' adapters to update this iteration (per-user policies; no Ray here).

The buffer holds rows of many users (``policy_user``, ``clawray.samples.policy_user_of``). Each
iteration the trainer updates a few users' adapters, one update per user on that user's rows
only (``clawray/learner/adapters.py``). ``plan_updates`` decides who and with how many rows:

- a user is eligible once they have ``min_rows`` waiting (fewer rows make a noisy update; they
  wait for more);
- eligible users are served least recently trained first (a user never trained first, then by
  the number of their last update, then by user id: deterministic), at most ``max_users`` per
  iteration;
- each takes at most ``max_rows`` rows, oldest first: a heavy user's backlog is worked off over
  several iterations while the others get their turn, so no user can starve another.

Rows of users not planned stay in the buffer (their leases are released), at its front. So
that rows of many users, each below ``min_rows``, cannot fill every take forever (each take
would see the same rows and train nobody), ``next_take`` doubles the next take after a full
take that trained nobody, up to a cap, and returns to the batch size once someone trains.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class UserUpdate:
    user: str
    rows: list[int]  # indices into the taken rows, oldest first


def plan_updates(users: Sequence[str | None], last_trained: Mapping[str, int], *,
                 min_rows: int, max_rows: int, max_users: int) -> list[UserUpdate]:
    """The updates of one iteration over taken rows whose policy users are ``users`` (in the
    buffer's order, oldest first; None: a row of no user, never planned). ``last_trained``:
    for each user trained before, the number of their last update (a counter over all users'
    updates, so no two users tie)."""
    if min_rows < 1 or max_rows < min_rows or max_users < 1:
        raise ValueError(f"need 1 <= min_rows <= max_rows and max_users >= 1; got min_rows="
                         f"{min_rows}, max_rows={max_rows}, max_users={max_users}")
    rows: dict[str, list[int]] = {}
    for i, user in enumerate(users):
        if user is not None:
            rows.setdefault(user, []).append(i)
    eligible = [u for u, ix in rows.items() if len(ix) >= min_rows]
    eligible.sort(key=lambda u: (u in last_trained, last_trained.get(u, 0), u))
    return [UserUpdate(u, rows[u][:max_rows]) for u in eligible[:max_users]]


def next_take(current: int, batch_size: int, *, trained: bool, taken: int, cap: int) -> int:
    """Rows the next per-user take asks for, after a take of ``current`` that returned
    ``taken`` rows and ``trained`` someone (or not): ``batch_size`` again after a training
    iteration; twice ``current`` (at most ``cap``) after a full take that trained nobody; the
    same after a short one (the buffer had no more rows: more must arrive)."""
    if trained:
        return batch_size
    return min(2 * current, max(cap, batch_size)) if taken >= current else current
