"""plan_updates (clawray/training/per_user.py): who is trained this iteration and on which rows."""

from __future__ import annotations

import pytest

from clawray.training.per_user import plan_updates


def test_users_below_the_minimum_wait_and_no_rows_mix():
    users = ["a", "b", "a", None, "c", "a", "b"]
    plan = plan_updates(users, {}, min_rows=2, max_rows=10, max_users=8)
    assert [(p.user, p.rows) for p in plan] == [("a", [0, 2, 5]), ("b", [1, 6])]
    for p in plan:  # every planned row is that user's
        assert {users[i] for i in p.rows} == {p.user}


def test_a_heavy_user_cannot_starve_the_others():
    """One user sends 100 rows per iteration, two others 3: over three iterations with room
    for two users each, everyone is trained, the heavy user at most max_rows at a time."""
    last: dict[str, int] = {}
    trained: dict[str, int] = {}
    updates = 0
    for _ in range(3):
        users = ["heavy"] * 100 + ["x"] * 3 + ["y"] * 3
        plan = plan_updates(users, last, min_rows=3, max_rows=8, max_users=2)
        for p in plan:
            assert len(p.rows) <= 8
            updates += 1
            last[p.user] = updates
            trained[p.user] = trained.get(p.user, 0) + 1
        assert len(plan) == 2
    assert trained == {"heavy": 2, "x": 2, "y": 2}


def test_never_trained_users_come_first_then_the_least_recent():
    plan = plan_updates(["old", "new", "older"] * 2, {"old": 5, "older": 2},
                        min_rows=1, max_rows=4, max_users=3)
    assert [p.user for p in plan] == ["new", "older", "old"]
    with pytest.raises(ValueError, match="min_rows"):
        plan_updates([], {}, min_rows=3, max_rows=2, max_users=1)


def test_a_take_that_trains_nobody_grows_the_next_one_until_someone_trains():
    from clawray.training.per_user import next_take

    n, sizes = 4, []
    for _ in range(6):  # full takes, nobody with enough rows: 8, 16, 32, then the cap
        n = next_take(n, 4, trained=False, taken=n, cap=40)
        sizes.append(n)
    assert sizes == [8, 16, 32, 40, 40, 40]
    assert next_take(32, 4, trained=False, taken=10, cap=40) == 32  # the buffer ran dry: wait
    assert next_take(32, 4, trained=True, taken=32, cap=40) == 4  # someone trained: back
    assert next_take(4, 4, trained=False, taken=4, cap=2) == 4  # never below the batch size
