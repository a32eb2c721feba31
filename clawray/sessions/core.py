"""The live-session state machine: turn records in, judge jobs and finished turns out.

Pure Python, no Ray and no clock of its own (every call takes ``now``), so each rule is a
millisecond unit test; ``clawray/sessions/hub.py`` is the actor shell that feeds it.

Life of a main turn (docs/sessions.md, "The rules"):

    awaiting ──(its reply found in a later main request)──► judging ──► held ──► emitted
       │                                                                 ▲
       ├──(regenerated / edited by the user)── signal -1 ────────────────┤
       └──(session done, idle timeout, superseded, cap)── no next state ─┘

``held`` waits ``feedback_window_s`` for explicit feedback before the turn is emitted. Side
turns only count as activity. Judge results for a session that has been released are still
emitted (the turn is not lost) but never recreate the session.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import OrderedDict
from typing import Any

from clawray.judging.jobs import JudgeJob, Verdict
from clawray.judging.parse import aggregate
from clawray.records import TurnRecord, tenant_prefix
from clawray.sessions.matching import (
    Fingerprinted,
    conversation_turn,
    find_reply,
    rewinds,
    same_request,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SessionRules:
    idle_timeout_s: float = 600.0
    feedback_window_s: float = 30.0
    max_sessions: int = 100_000
    max_pending_turns: int = 64
    history_turns: int = 4
    at_least_one: bool = True
    regenerate_reward: float | None = -1.0
    reward_rule: str = "majority"
    step_score_weight: float = 1.0

    @classmethod
    def from_config(cls, cfg: Any) -> "SessionRules":
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class FinishedTurn:
    """A main turn whose fate is decided; ``clawray/sessions/rows.py`` makes samples of it."""

    record: TurnRecord
    turn: int
    status: str  # judged | unjudged | no_next_state | regenerated | aborted
    next_state: list[dict[str, Any]] | None = None
    verdict: Verdict | None = None
    outcome: int | None = None  # explicit feedback (turn, else session), -1 / +1
    outcome_scope: str | None = None  # turn | session
    feedback_text: str | None = None
    at_least_one: bool = False
    soft_score: float | None = None  # mean of valid votes, used by the at-least-one rule
    judged_at: float | None = None


@dataclasses.dataclass
class _Turn:
    fp: Fingerprinted
    turn: int
    state: str = "awaiting"  # awaiting | judging | held
    finished: FinishedTurn | None = None
    release_at: float = 0.0
    feedback: tuple[int, str | None] | None = None
    next_state: list[dict[str, Any]] | None = None
    job_id: int | None = None  # the judge job in flight, while judging

    @property
    def record(self) -> TurnRecord:
        return self.fp.record


@dataclasses.dataclass
class _Session:
    session_id: str
    last_activity: float
    turns: dict[str, _Turn] = dataclasses.field(default_factory=dict)  # record_id → turn
    effective: int = 0  # emitted turns that carry gradient
    candidate: _Turn | None = None  # first zero-score turn, held for the at-least-one rule
    outcome: tuple[int, str | None] | None = None  # session-level feedback


@dataclasses.dataclass
class _Closed:
    """What late verdicts of a released session need for the at-least-one rule."""

    effective: int
    used: bool


class SessionCore:
    def __init__(self, rules: SessionRules | None = None) -> None:
        self.rules = rules or SessionRules()
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently active first
        self.index: dict[str, str] = {}  # record_id → session_id, for held turns
        self.orphans: dict[int, tuple[_Turn, _Closed]] = {}  # job_id → turn of a released session
        self.jobs: dict[int, tuple[str, str]] = {}  # job_id → (session_id, record_id)
        self.seen: OrderedDict[str, None] = OrderedDict()  # recent record ids (retried puts)
        # recent emitted ids → (time, session key)
        self.emitted: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.held: dict[str, str] = {}  # record_id → session_id of turns in their window
        self._job_ids = itertools.count(1)
        self._out_jobs: list[JudgeJob] = []
        self._out_done: list[FinishedTurn] = []
        self.counters: dict[str, int] = {k: 0 for k in (
            "turns", "side_turns", "duplicates", "judge_jobs", "judged", "unjudged",
            "no_next_state", "regenerated", "aborted", "sessions_done", "sessions_idle",
            "sessions_capped", "emitted", "at_least_one", "late_results")}

    # ------------------------------------------------------------------ inputs
    def on_record(self, record: TurnRecord, now: float) -> None:
        """A served turn (main or side), in any order, possibly more than once."""
        if record.record_id in self.seen:
            self.counters["duplicates"] += 1
            return
        self._remember(self.seen, record.record_id, None, 4 * self.rules.max_sessions)
        session = self._session(record.session_key(), now)
        if record.turn_type != "main":
            self.counters["side_turns"] += 1
        else:
            self._on_main(session, Fingerprinted.of(record), now)
        if record.session_done:
            self._close(session, now, "sessions_done")

    def on_verdict(self, job_id: int, verdict: Verdict, now: float) -> None:
        """The judges' answer for a job (possibly after its session was released)."""
        if job_id in self.orphans:
            turn, closed = self.orphans.pop(job_id)
            self.counters["late_results"] += 1
            self._judged(None, turn, verdict, now)
            fin = turn.finished
            assert fin is not None
            if _trainable(fin, self.rules):
                closed.effective += 1
            elif closed.effective == 0 and not closed.used and fin.status == "judged":
                fin.at_least_one = closed.used = True  # the released session had no sample yet
                self.counters["at_least_one"] += 1
            self._emit(None, turn)
            return
        where = self.jobs.pop(job_id, None)
        if where is None:
            logger.warning("verdict for unknown judge job %d ignored", job_id)
            return
        session = self.sessions.get(where[0])
        turn = session.turns.get(where[1]) if session else None
        if turn is None or turn.state != "judging":
            logger.warning("verdict for job %d has no judging turn", job_id)
            return
        self._judged(session, turn, verdict, now)

    def on_feedback(self, rating: int, text: str | None, now: float, *, record_id: str | None = None,
                    session_key: str | None = None, tenant: str | None = None) -> dict[str, Any]:
        """Explicit feedback for one turn (by response id) or a whole session (by its key,
        ``TurnRecord.session_key``).

        Returns ``{"status": "applied" | "sealed" | "unknown", ...}``: ``sealed`` when the turn
        was already emitted (its sample is in the log), ``unknown`` when nothing matches. With
        ``tenant``, a turn or session of another tenant is ``unknown`` (never ``sealed``: the
        answer must not reveal that it exists).
        """
        if rating not in (-1, 1):
            raise ValueError(f"rating must be -1 or 1, got {rating!r}")
        mine = (lambda key: True) if tenant is None else (  # noqa: E731
            lambda key: key.startswith(tenant_prefix(tenant)))
        if record_id is not None:
            key = self.index.get(record_id)
            session = self.sessions.get(key) if key and mine(key) else None
            turn = session.turns.get(record_id) if session else None
            if turn is None:  # its session ended while its verdict is on the way
                turn = next((t for t, _ in self.orphans.values()
                             if t.record.record_id == record_id
                             and mine(t.record.session_key())), None)
                if turn is not None:
                    turn.feedback = (rating, text)  # applied when the verdict arrives
                    return {"status": "applied", "response_id": record_id,
                            "session_id": turn.record.session_key(),
                            "client_session_id": turn.record.session_id, "turns": 1}
                emitted = self.emitted.get(record_id)
                status = "sealed" if emitted is not None and mine(emitted[1]) else "unknown"
                return {"status": status, "response_id": record_id}
            turn.feedback = (rating, text)
            if turn.finished is not None:
                self._apply_feedback(turn)
            return {"status": "applied", "response_id": record_id, "session_id": key,
                    "client_session_id": turn.record.session_id, "turns": 1}
        session = self.sessions.get(session_key or "")
        if session is None or not mine(session.session_id):
            return {"status": "unknown", "session_id": session_key}
        session.outcome = (rating, text)
        client_id = None
        for turn in session.turns.values():
            client_id = turn.record.session_id
            if turn.finished is not None:
                self._apply_feedback(turn, session)
        return {"status": "applied", "session_id": session_key, "client_session_id": client_id,
                "turns": len(session.turns)}

    def tick(self, now: float) -> None:
        """Finalize idle sessions and release held turns whose feedback window has passed."""
        idle = []
        for session in self.sessions.values():  # least recently active first
            if now - session.last_activity < self.rules.idle_timeout_s:
                break
            idle.append(session)
        for session in idle:
            self._close(session, now, "sessions_idle")
        for record_id, session_id in list(self.held.items()):
            session = self.sessions.get(session_id)
            turn = session.turns.get(record_id) if session else None
            if turn is not None and turn.state == "held" and now >= turn.release_at:
                self._release(session, turn)

    def resumed(self, now: float) -> None:
        """The hub holding these sessions was down until ``now`` (a restart replayed them from
        its journal): a user's next message could not reach it meanwhile, so the downtime is not
        their idle time. Every session gets a whole idle window from ``now``, in its order."""
        for session in self.sessions.values():
            session.last_activity = max(session.last_activity, now)

    def drain(self) -> tuple[list[JudgeJob], list[FinishedTurn]]:
        jobs, done = self._out_jobs, self._out_done
        self._out_jobs, self._out_done = [], []
        return jobs, done

    def stats(self) -> dict[str, Any]:
        held = sum(len(s.turns) for s in self.sessions.values())
        return {**self.counters, "sessions": len(self.sessions), "turns_held": held,
                "judging": len(self.jobs) + len(self.orphans)}

    # ------------------------------------------------------------------ main turns
    def _on_main(self, session: _Session, new: Fingerprinted, now: float) -> None:
        self.counters["turns"] += 1
        record = new.record
        awaiting = [t for t in session.turns.values() if t.state == "awaiting"]
        # 1. the new request carries the next state of earlier turns
        matched = []
        for turn in awaiting:
            m = find_reply(turn.fp, new)
            if m is not None:
                matched.append(turn)
                self._start_judging(session, turn, m.next_state, m.ephemeral_tail)
        # 2. turns answering the same request as a matched one were not chosen by the client
        for turn in awaiting:
            if turn.state == "awaiting" and any(same_request(turn.fp, t.fp) for t in matched):
                self._finish(session, turn, "no_next_state", now)
        # 3. a resend without the reply, after the user saw it: regenerated or edited
        if not record.retry:
            for turn in awaiting:
                if (turn.state == "awaiting" and record.started_at >= turn.record.finished_at
                        and turn.record.finish_reason != "abort" and rewinds(turn.fp, new)):
                    self._finish(session, turn, "regenerated", now)
        # 4. register the new turn; a record that arrives late may already have its next state
        turn = _Turn(new, conversation_turn(record))
        session.turns[record.record_id] = turn
        self.index[record.record_id] = session.session_id
        if record.finish_reason == "abort":
            self._finish(session, turn, "aborted", now)
            return
        for other in session.turns.values():
            if other is turn or other.record.started_at < record.finished_at:
                continue
            m = find_reply(new, other.fp)
            if m is not None:
                self._start_judging(session, turn, m.next_state, m.ephemeral_tail)
                break
        self._cap_pending(session, now)

    def _start_judging(self, session: _Session, turn: _Turn, next_state: list[dict[str, Any]],
                       ephemeral_tail: bool) -> None:
        msgs = turn.record.messages
        real = msgs[:-1] if ephemeral_tail else msgs
        start = turn.fp.request_start
        history = real[:start]
        if self.rules.history_turns >= 0:
            history = history[max(0, len(history) - self.rules.history_turns):]
        # The teacher (OPD) sees exactly what the student saw, ephemeral context included; the
        # hint goes on the last real user message (opd.inject_hint).
        job = JudgeJob(next(self._job_ids), session.session_id, turn.record, history,
                       real[start:], next_state, msgs)
        turn.state = "judging"
        turn.finished = None
        turn.job_id = job.job_id
        self.jobs[job.job_id] = (session.session_id, turn.record.record_id)
        self.counters["judge_jobs"] += 1
        self._out_jobs.append(job)
        turn.next_state = next_state

    def _judged(self, session: _Session | None, turn: _Turn, verdict: Verdict, now: float) -> None:
        status = "judged" if verdict.status == "judged" else "unjudged"
        self.counters[status] += 1
        valid = verdict.valid_votes
        fin = FinishedTurn(turn.record, turn.turn, status, turn.next_state, verdict, judged_at=now,
                           soft_score=(sum(valid) / len(valid)) if valid else None)
        self._hold(session, turn, fin, now)

    def _finish(self, session: _Session, turn: _Turn, status: str, now: float) -> None:
        """A turn that gets no judgment: no next state, regenerated or aborted."""
        if turn.state == "judging":  # its job is in flight: let the verdict decide
            return
        self.counters[status] += 1
        self._hold(session, turn, FinishedTurn(turn.record, turn.turn, status), now)

    def _hold(self, session: _Session | None, turn: _Turn, fin: FinishedTurn, now: float) -> None:
        turn.finished = fin
        turn.state = "held"
        turn.release_at = now + self.rules.feedback_window_s
        self._apply_feedback(turn, session)
        if session is None:
            return  # a late verdict: on_verdict emits it
        if self.rules.feedback_window_s <= 0:
            self._release(session, turn)
        else:
            self.held[turn.record.record_id] = session.session_id

    def _apply_feedback(self, turn: _Turn, session: _Session | None = None) -> None:
        fin = turn.finished
        assert fin is not None
        if turn.feedback is not None:
            (fin.outcome, fin.feedback_text), fin.outcome_scope = turn.feedback, "turn"
        elif session is not None and session.outcome is not None:
            (fin.outcome, fin.feedback_text), fin.outcome_scope = session.outcome, "session"

    # ------------------------------------------------------------------ release and emission
    def _release(self, session: _Session | None, turn: _Turn) -> None:
        """Emit a held turn, or keep it as the session's at-least-one candidate."""
        fin = turn.finished
        assert fin is not None
        self.held.pop(turn.record.record_id, None)
        if session is not None:
            session.turns.pop(turn.record.record_id, None)
            if (self.rules.at_least_one and session.effective == 0 and fin.status == "judged"
                    and not _trainable(fin, self.rules)):
                if session.candidate is None:
                    session.candidate = turn
                    return
        self._emit(session, turn)

    def _emit(self, session: _Session | None, turn: _Turn) -> None:
        fin = turn.finished
        assert fin is not None
        self.index.pop(turn.record.record_id, None)
        if session is not None and _trainable(fin, self.rules):
            session.effective += 1
            if session.candidate is not None:  # the guarantee is no longer needed
                cand, session.candidate = session.candidate, None
                self._emit(session, cand)
        self._remember(self.emitted, turn.record.record_id,
                       (fin.judged_at or 0.0, turn.record.session_key()),
                       4 * self.rules.max_sessions)
        self.counters["emitted"] += 1
        self._out_done.append(fin)

    def _close(self, session: _Session, now: float, reason: str) -> None:
        """session_done or idle timeout: finalize everything and release the session."""
        self.counters[reason] += 1
        closed = _Closed(session.effective, used=not self.rules.at_least_one)
        for turn in list(session.turns.values()):
            if turn.state == "awaiting":
                self._finish(session, turn, "no_next_state", now)
        for turn in list(session.turns.values()):
            if turn.state == "held":
                self._release(session, turn)
            elif turn.state == "judging":  # the verdict will be emitted on arrival
                assert turn.job_id is not None
                del self.jobs[turn.job_id]
                self.orphans[turn.job_id] = (turn, closed)
                self.index.pop(turn.record.record_id, None)
        if session.candidate is not None:
            closed.used = True
            cand, session.candidate = session.candidate, None
            cand.finished.at_least_one = True  # type: ignore[union-attr]
            self.counters["at_least_one"] += 1
            self._emit(session, cand)
        self.sessions.pop(session.session_id, None)

    # ------------------------------------------------------------------ bookkeeping
    def _session(self, session_id: str, now: float) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.rules.max_sessions:
                oldest = next(iter(self.sessions.values()))
                self._close(oldest, now, "sessions_capped")
                capped = self.counters["sessions_capped"]
                if capped in (1, 10, 100) or capped % 1000 == 0:
                    logger.warning(
                        "session cap of %d reached: finalized the idlest session %s (idle %.0f s);"
                        " %d sessions finalized by the cap so far (raise sessions.max_sessions or "
                        "add hubs)", self.rules.max_sessions, oldest.session_id,
                        now - oldest.last_activity, capped)
            session = _Session(session_id, now)
            self.sessions[session_id] = session
        session.last_activity = now
        self.sessions.move_to_end(session_id)
        return session

    def _cap_pending(self, session: _Session, now: float) -> None:
        awaiting = [t for t in session.turns.values() if t.state == "awaiting"]
        for turn in awaiting[: max(0, len(awaiting) - self.rules.max_pending_turns)]:
            self._finish(session, turn, "no_next_state", now)

    @staticmethod
    def _remember(store: OrderedDict, key: str, value: Any, cap: int) -> None:
        store[key] = value
        if len(store) > cap:
            store.popitem(last=False)


def _trainable(fin: FinishedTurn, rules: SessionRules) -> bool:
    """Whether the turn's RL sample carries gradient (see clawray/sessions/rows.py)."""
    if fin.outcome_scope == "turn":
        return True
    if fin.status == "regenerated":
        return rules.regenerate_reward not in (None, 0)
    if fin.status == "judged" and fin.verdict is not None:
        return score_of(fin.verdict.votes) != 0
    if fin.at_least_one:
        return bool(fin.soft_score)
    return False


def score_of(votes: list[int | None]) -> int:
    """Majority of valid votes; a tie or no valid vote gives 0."""
    return aggregate(votes).score
