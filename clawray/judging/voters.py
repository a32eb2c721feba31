"""PRM voters: Ray actors that call a judge backend, and the pool that judges one turn.

``PRMVoter`` actors each hold a judge backend (function, JudgeServer handle or external
endpoint) and serve many calls concurrently (async actors). ``VoterPool`` runs the ``m`` votes
of a turn as one n=m call on one voter (a JudgeServer shares the prompt prefill across them),
spreads turns over the voters, judges at most ``judge.max_inflight`` turns at once (the others
wait in its backlog: ``admission.py``), and bounds every call by a timeout with retries. A turn
whose judge fails or hangs, or that is shed from a full backlog, is returned as ``unjudged`` —
never lost, never blocking serving — and is counted in the metrics.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
from typing import Any

import ray
from ray import serve

from clawray.config import JudgeConfig
from clawray.judging.admission import Admission
from clawray.judging.backends import JudgeUnavailable, make_backend, needs_server
from clawray.judging.jobs import JudgeJob, Verdict
from clawray.judging.opd import inject_hint, select_hint
from clawray.judging.parse import parse_hint_vote, parse_vote
from clawray.judging.prompts import JudgeRequest, TurnContext, build_judge_request

logger = logging.getLogger(__name__)
SHUFFLE_POOL = 64  # judge.control 'shuffled_feedback' draws from this many earlier turns
HIDDEN_REPLY = "[reply hidden]"  # judge.control 'reply_hidden'


@ray.remote(num_cpus=0)
class PRMVoter:
    """One judge backend behind an async actor."""

    def __init__(self, judge: dict[str, Any], app_name: str | None = None) -> None:
        cfg = JudgeConfig.model_validate(judge)
        handle = None
        if needs_server(cfg):
            handle = serve.get_deployment_handle("JudgeServer", app_name=app_name or "clawray")
        self.backend = make_backend(cfg, handle)

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        return await self.backend.complete(request, n, temperature, max_tokens)

    async def teacher_logprobs(self, messages: list[dict], tools: list[dict] | None,
                               response_ids: list[int]) -> list[float]:
        return await self.backend.teacher_logprobs(messages, tools, response_ids)

    def ping(self) -> bool:
        return True


class VoterPool:
    """Judges turns with m votes (and, for OPD, hints and teacher log-probs)."""

    def __init__(self, voters: list[Any], cfg: JudgeConfig, kinds: list[str]) -> None:
        if not voters:
            raise ValueError("VoterPool needs at least one PRMVoter")
        self.voters = voters
        self.cfg = cfg
        self.want_hints = bool({"opd", "combine"} & set(kinds))
        self._next = itertools.cycle(range(len(voters)))
        self.counters = {k: 0 for k in ("calls", "call_failures", "timeouts", "votes",
                                        "parse_failures", "unjudged", "hints", "teacher_failures",
                                        "shed")}
        self.latencies: list[float] = []  # judge latencies (s) not yet exported as metrics
        self.admission = Admission(cfg.max_inflight, cfg.backlog_order, cfg.max_backlog)
        # judge.control 'shuffled_feedback': the next states of the last turns judged here
        self._earlier: collections.deque[list[dict[str, Any]]] = collections.deque(
            maxlen=SHUFFLE_POOL)
        self._shuffle_rng = random.Random(0)

    def load(self) -> dict[str, int]:
        """Turns being judged now (``running``) and waiting for a slot (``waiting``)."""
        return {"running": self.admission.running, "waiting": self.admission.waiting}

    async def judge(self, job: JudgeJob) -> Verdict:
        """The turn's verdict, once one of the ``max_inflight`` slots is free."""
        if not await self.admission.acquire():
            self.counters["shed"] += 1
            self.counters["unjudged"] += 1
            return Verdict("unjudged", error=f"shed: more than {self.cfg.max_backlog} turns "
                                             "waited for the judge (judge.max_backlog)")
        try:
            return await self._judge(job)
        finally:
            self.admission.release()

    def context(self, job: JudgeJob) -> TurnContext:
        """What the judge reads of ``job``'s turn: all of it, or under ``judge.control`` the
        reply hidden, or the next state of an earlier turn in place of the turn's own (the
        first turn judged gets an empty one: nothing said)."""
        reply, calls, next_state = job.record.response_text, job.record.tool_calls, job.next_state
        if self.cfg.control == "reply_hidden":
            reply, calls = HIDDEN_REPLY, []
        elif self.cfg.control == "shuffled_feedback":
            earlier = self._shuffle_rng.choice(self._earlier) if self._earlier else []
            self._earlier.append(next_state)
            next_state = earlier
        return TurnContext(history=job.history, request=job.request, response_text=reply,
                           response_tool_calls=calls, next_state=next_state)

    async def _judge(self, job: JudgeJob) -> Verdict:
        ctx = self.context(job)
        start = time.monotonic()
        texts, error = await self._call("complete", build_judge_request("prm", ctx),
                                        self.cfg.m, self.cfg.temperature, self.cfg.max_tokens)
        if texts is None:
            self.counters["unjudged"] += 1
            return Verdict("unjudged", error=error)
        votes = [parse_vote(t) for t in texts]
        self.counters["votes"] += len(votes)
        self.counters["parse_failures"] += sum(v is None for v in votes)
        verdict = Verdict("judged", votes)
        if self.want_hints:
            await self._hint(job, ctx, verdict)
        self.latencies.append(time.monotonic() - start)
        del self.latencies[:-10_000]
        return verdict

    async def _hint(self, job: JudgeJob, ctx: TurnContext, verdict: Verdict) -> None:
        """OPD: m hint votes; with enough agreement, teacher log-probs under the hinted prompt."""
        texts, _ = await self._call("complete", build_judge_request("opd", ctx), self.cfg.m,
                                    self.cfg.temperature, self.cfg.max_tokens)
        if not texts:
            return
        hint = select_hint([parse_hint_vote(t, self.cfg.hint_max_chars) for t in texts],
                           self.cfg.opd_min_agree, self.cfg.hint_min_chars)
        if hint is None:
            return
        self.counters["hints"] += 1
        hinted = inject_hint(job.hint_messages, hint)
        teacher, error = await self._call("teacher_logprobs", hinted, job.record.tools,
                                          job.record.response_ids)
        if teacher is None or len(teacher) != len(job.record.response_ids):
            self.counters["teacher_failures"] += 1
            logger.warning("no teacher log-probs for %s (session %s): %s", job.record.record_id,
                           job.session_id, error or "length mismatch")
            return
        verdict.hint, verdict.teacher_logprobs = hint, list(teacher)

    async def _call(self, method: str, *args: Any) -> tuple[Any, str | None]:
        """One voter call with timeout and retries; (result, None) or (None, last error)."""
        error = None
        for attempt in range(self.cfg.retries + 1):
            voter = self.voters[next(self._next)]
            self.counters["calls"] += 1
            ref = getattr(voter, method).remote(*args)
            try:
                return await asyncio.wait_for(_await(ref), self.cfg.timeout_s), None
            except asyncio.TimeoutError:
                self.counters["timeouts"] += 1
                error = f"judge call timed out after {self.cfg.timeout_s:g} s"
                ray.cancel(ref)
            except JudgeUnavailable as e:  # retrying cannot help (e.g. no teacher scoring)
                self.counters["call_failures"] += 1
                return None, f"JudgeUnavailable: {e}"
            except Exception as e:  # a judge failure is data about the judge, not a crash
                self.counters["call_failures"] += 1
                error = f"{type(e).__name__}: {e}"
            logger.warning("judge %s attempt %d/%d failed: %s", method, attempt + 1,
                           self.cfg.retries + 1, error)
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
        return None, error


async def _await(ref: Any) -> Any:
    return await ref
