"""The VoterPool's admission: at most max_inflight turns judged at once, the backlog served in
its order, shed beyond max_backlog, and a call's timeout counting only the judge's time."""

import asyncio

import pytest

from clawray.config import JudgeConfig
from clawray.judging.admission import Admission
from clawray.judging.voters import VoterPool
from clawray.records import TurnRecord
from clawray.sessions.core import JudgeJob

SYS = {"role": "system", "content": "sys"}


class _SlowVoter:
    """A voter whose calls take ``delay`` s; records how many run at once and their order."""

    def __init__(self, delay: float) -> None:
        self.delay, self.running, self.peak, self.order = delay, 0, 0, []
        outer = self

        class _M:
            def remote(self, request, n, temperature, max_tokens):
                return asyncio.ensure_future(outer._complete(request, n))

        self.complete = _M()

    async def _complete(self, request, n):
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.order.append(request.messages[-1]["content"])
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        return ["\\boxed{1}"] * n


def _job(i: int) -> JudgeJob:
    rec = TurnRecord(f"r{i}", f"s{i}", "header", "main", False, "m", [1], [2], [-0.5], "stop", 0,
                     None, [SYS, {"role": "user", "content": "hi"}], None, {}, "hello", [])
    return JudgeJob(i, f"s{i}", rec, [], rec.messages[1:],
                    [{"role": "user", "content": f"turn-{i}-next"}], rec.messages)


def _judge_all(pool: VoterPool, n: int):
    async def main():  # submitted in order, like a hub's turns
        return await asyncio.gather(*(pool.judge(_job(i)) for i in range(n)))
    return asyncio.run(main())


def _index(prompt: str) -> int:
    return int(prompt.split("turn-")[1].split("-next")[0])


def test_at_most_max_inflight_turns_are_judged_and_waiting_does_not_count_toward_timeout():
    voter = _SlowVoter(delay=0.2)
    # 20 turns of 0.2 s, two at a time: 2 s in all, twice a 1 s timeout; no call times out
    # because a turn's timeout starts when it is admitted. (A call has five times its 0.2 s to
    # finish: a loaded machine does not make it time out; counted from submission instead,
    # the last turns would wait 1.8 s.)
    pool = VoterPool([voter], JudgeConfig(m=3, max_inflight=2, timeout_s=1.0, retries=0),
                     ["rl"])
    verdicts = _judge_all(pool, 20)
    assert voter.peak == 2
    assert [v.status for v in verdicts] == ["judged"] * 20
    assert pool.counters["timeouts"] == 0 and pool.counters["calls"] == 20
    assert pool.load() == {"running": 0, "waiting": 0}


def test_without_a_bound_the_same_load_times_out(monkeypatch):
    """The control for the test above: every call sent at once queues on one slow judge."""
    # the stand-in voter's calls are asyncio tasks, not object refs: cancel them as such
    monkeypatch.setattr("clawray.judging.voters.ray.cancel", lambda ref: ref.cancel())

    class _Serial(_SlowVoter):
        lock = None

        async def _complete(self, request, n):  # a judge that serves one call at a time
            self.lock = self.lock or asyncio.Lock()
            async with self.lock:
                return await super()._complete(request, n)

    # 8 calls of 0.2 s and a 1 s timeout: one at a time, each has five times its time; all at
    # once, the fifth ends at 1 s at the earliest, so at least the last three time out (more
    # on a slow machine).
    serial = _Serial(0.2)
    bounded = VoterPool([serial], JudgeConfig(max_inflight=1, timeout_s=1.0, retries=0), ["rl"])
    assert all(v.status == "judged" for v in _judge_all(bounded, 8))
    serial2 = _Serial(0.2)
    unbounded = VoterPool([serial2], JudgeConfig(max_inflight=100, timeout_s=1.0, retries=0),
                          ["rl"])
    verdicts = _judge_all(unbounded, 8)
    assert sum(v.status == "unjudged" for v in verdicts) >= 3
    assert unbounded.counters["timeouts"] >= 3


@pytest.mark.parametrize("order,expected", [("oldest", [0, 1, 2, 3, 4, 5]),
                                            ("newest", [0, 5, 4, 3, 2, 1])])
def test_the_backlog_is_served_in_its_order(order, expected):
    voter = _SlowVoter(delay=0.05)
    pool = VoterPool([voter], JudgeConfig(max_inflight=1, backlog_order=order), ["rl"])
    _judge_all(pool, 6)
    assert [_index(p) for p in voter.order] == expected


def test_beyond_max_backlog_the_oldest_waiting_turn_is_shed_and_counted():
    voter = _SlowVoter(delay=0.05)
    pool = VoterPool([voter], JudgeConfig(max_inflight=1, max_backlog=2), ["rl"])
    verdicts = _judge_all(pool, 6)
    # turn 0 runs; 1..5 wait in a backlog of 2: 1, 2, 3 are shed as 4 and 5 arrive
    assert [v.status for v in verdicts] == ["judged", "unjudged", "unjudged", "unjudged",
                                            "judged", "judged"]
    assert "judge.max_backlog" in verdicts[1].error
    assert pool.counters["shed"] == 3 and pool.counters["unjudged"] == 3
    assert [_index(p) for p in voter.order] == [0, 4, 5]


def test_a_cancelled_waiting_turn_leaves_the_backlog_and_a_cancelled_running_one_its_slot():
    async def main():
        gate = Admission(1)
        assert await gate.acquire()
        waiter = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0)
        assert gate.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.waiting == 0 and gate.running == 1
        # admitted as it is cancelled: the slot passes on instead of leaking
        second = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0)
        gate.release()  # hands the slot to `second`
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert gate.running == 0 and gate.waiting == 0
        assert await gate.acquire() and gate.running == 1
    asyncio.run(main())


def test_admission_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_inflight"):
        Admission(0)
    with pytest.raises(ValueError, match="order"):
        Admission(1, "random")
