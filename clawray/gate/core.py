"""The policy gate's rules (no Ray): candidates, shadow evaluation, canary, rollback.

Each version the trainer publishes is a *candidate*; the *incumbent* keeps serving everyone
until the candidate passes:

1. **shadow**: the candidate and the incumbent answer the same held-out set; the candidate is
   rejected when a health check fails (``clawray/gate/health.py``) or its mean score is lower
   than the incumbent's, or than the reference's (the first incumbent's, a fixed anchor), by
   more than ``shadow_margin``.
2. **canary**: a share of sessions (``canary_share``, sticky: a session key hashes to the
   candidate or not for the whole canary) is served by the candidate; the judge's rewards of
   the turns each side served during the canary are compared. Every ``canary_min_turns``
   candidate turns (both sides at least that many) a one-sided test runs at
   ``canary_alpha / canary_looks`` (Bonferroni over the looks, so peeking keeps the error
   rate): promote when the candidate is non-inferior (its mean reward minus the incumbent's,
   lower confidence bound, above ``-canary_margin``), roll back when it is significantly worse
   (upper bound below 0); after ``canary_looks`` undecided looks, roll back.
3. **promote / reject / roll back**: a promoted candidate becomes the incumbent. What a
   rejection or rollback does to training is ``on_reject``:

   - ``restart``: the candidate is abandoned, with every version published after it (they
     descend from it): ``line`` counts abandonments, and the trainer, seeing it change,
     restarts from the incumbent's weights and drops rows the abandoned versions sampled
     (``abandoned``);
   - ``keep_line``: only the candidate is set aside (``rejected``: never served again); the
     trainer's line goes on, with its rows, and the next version it publishes (the queued one
     first) becomes the next candidate. The gate then guards serving only.

   An operator's rollback or pin always abandons the line (restart).

While a candidate is pending the trainer keeps training its line; the versions it publishes
meanwhile wait (only the newest: ``queued``) and become the next candidate once this one is
promoted. The last ``keep`` versions (never the incumbent or a pending one) are kept, so the
operator can roll back to any of them without the trainer. Version 0 is the base model.

Every decision is an event (``events``; the actor appends them to a JSONL log).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from clawray.gate import significance
from clawray.gate.health import health_problems

BASE = 0  # version 0: the base model, always available


def adapter_name(version: int) -> str:
    """The adapter a gated version is served as (``~`` starts no tenant id or user name)."""
    return f"~gate/v{version}"


def canary_bucket(session_key: str, salt: str) -> float:
    """A session key's place in [0, 1) for one canary: sticky for that canary, independent
    across canaries (the salt names the candidate)."""
    h = hashlib.sha256(f"{salt}\x00{session_key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


def routed_side(routing: Mapping[str, Any] | None, session_key: str) -> str | None:
    """The one routing rule, on a routing table (``GateCore.routing``, as replicas mirror it):
    "candidate" for a session in the running canary (its key's bucket under the canary's salt
    below the share: sticky for that canary), "incumbent" for every other session while a gate
    runs, None without a gate."""
    if not routing:
        return None
    if routing.get("candidate") is not None and \
            canary_bucket(session_key, routing["salt"]) < routing["share"]:
        return "candidate"
    return "incumbent"


SIDES = ("candidate", "incumbent")
SERVING_FIELDS = ("requests", "errors", "timed", "s_per_token", "s_per_token_sq")


class ServingTally:
    """A replica's serving signals during canaries: per canary (its salt) and side, requests,
    server errors (5xx) and seconds per generated token of each finished request (sum and sum
    of squares). Cumulative: the replica reports its whole tally, the control actor keeps the
    newest per replica and sums over replicas (``merge_serving``), so a lost or repeated report
    changes nothing."""

    KEPT = 4  # canaries kept (the newest)

    def __init__(self) -> None:
        self.by_salt: dict[str, dict[str, dict[str, float]]] = {}
        self.changes = 0

    def add(self, salt: str, side: str, *, error: bool = False, seconds: float | None = None,
            tokens: int = 0) -> None:
        if not salt or side not in SIDES:
            return
        if salt not in self.by_salt:
            self.by_salt[salt] = {sd: dict.fromkeys(SERVING_FIELDS, 0.0) for sd in SIDES}
            for old in list(self.by_salt)[:-self.KEPT]:
                del self.by_salt[old]
        t = self.by_salt[salt][side]
        t["requests"] += 1
        if error:
            t["errors"] += 1
        elif seconds is not None and tokens > 0:
            per = seconds / tokens
            t["timed"] += 1
            t["s_per_token"] += per
            t["s_per_token_sq"] += per * per
        self.changes += 1

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        return {salt: {sd: dict(t) for sd, t in sides.items()}
                for salt, sides in self.by_salt.items()}


def merge_serving(reports: list[dict[str, Any]], salt: str) -> dict[str, dict[str, float]]:
    """One canary's serving signals summed over replicas' tallies (``ServingTally.snapshot``)."""
    out = {sd: dict.fromkeys(SERVING_FIELDS, 0.0) for sd in SIDES}
    for rep in reports:
        for sd, t in (rep.get(salt) or {}).items():
            if sd in out:
                for k in SERVING_FIELDS:
                    out[sd][k] += float(t.get(k, 0.0))
    return out


@dataclass
class GateSettings:
    """The thresholds of ``GateConfig`` the rules use (plain values, no pydantic)."""

    keep: int = 4
    shadow_margin: float = 0.05
    min_readable: float = 0.8
    max_empty: float = 0.2
    max_length_ratio: float = 3.0
    max_broken_tool_calls: float = 0.1
    shadow_alpha: float = 0.05
    canary_share: float = 0.1
    canary_min_turns: int = 40
    canary_looks: int = 5
    canary_alpha: float = 0.05
    canary_margin: float = 0.1
    canary_max_error_increase: float = 0.02
    canary_max_latency_ratio: float = 1.5
    canary_max_regenerate_increase: float = 0.05
    on_reject: str = "restart"  # "restart": abandon the line | "keep_line": gate serving only

    @classmethod
    def of(cls, cfg: Any) -> "GateSettings":
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})


@dataclass
class Arm:
    """Running sums of one side's canary rewards."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    regenerated: int = 0  # turns the user regenerated (or edited)
    feedback: int = 0  # turns with the user's own rating
    feedback_total: float = 0.0

    def add(self, reward: float, status: str = "judged") -> None:
        self.n += 1
        self.total += reward
        self.total_sq += reward * reward
        if status == "regenerated":
            self.regenerated += 1
        elif status == "feedback":
            self.feedback += 1
            self.feedback_total += reward

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def var(self) -> float:
        if self.n < 2:
            return math.nan
        return _mean_var(self.total, self.total_sq, self.n)[1]

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total, "total_sq": self.total_sq,
                "regenerated": self.regenerated, "feedback": self.feedback,
                "feedback_total": self.feedback_total}


@dataclass
class GateCore:
    """The gate's state and rules. ``clock`` gives wall time (tests pass their own)."""

    settings: GateSettings = field(default_factory=GateSettings)
    clock: Callable[[], float] = time.time
    incumbent: int = BASE
    candidate: int | None = None
    phase: str | None = None  # "shadow" | "canary" while a candidate is pending
    queued: int | None = None  # newest version published while a candidate was pending
    pinned: bool = False
    line: int = 0  # abandonments so far (the trainer restarts from the incumbent on a change)
    kept: list[int] = field(default_factory=list)  # published versions kept, oldest first
    abandoned: set[int] = field(default_factory=set)
    rejected: set[int] = field(default_factory=set)  # keep_line: set aside, line kept
    published: int = BASE  # the newest version the trainer published
    look: int = 0  # canary tests run so far
    canary_started: float | None = None
    arms: dict[str, Arm] = field(default_factory=lambda: {"candidate": Arm(),
                                                          "incumbent": Arm()})
    # the replicas' serving signals of the running canary (``merge_serving``)
    serving: dict[str, dict[str, float]] = field(default_factory=dict)
    evidence: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    event_seq: int = 0  # events so far (each event's "seq")
    # the first shadow evaluation's incumbent: its readable rate and mean score are fixed
    # anchors (a candidate must not fall too far below the incumbent, nor below them: no
    # creeping down one margin per version)
    reference_readable: float | None = None
    reference_score: float | None = None

    # ---- the trainer's side ------------------------------------------------------------------

    def propose(self, version: int, line: int | None = None) -> dict[str, Any]:
        """The trainer published ``version`` (its payload is kept by the caller), trained on
        the line it last saw (``line``): a version trained on a line abandoned since (the
        trainer had not noticed yet) descends from a rejected candidate and is discarded."""
        if version <= self.published:
            raise ValueError(f"version {version} is not newer than the last published "
                             f"{self.published}")
        self.published = version
        if line is not None and line != self.line:
            self.abandoned.add(version)
            return self._event("discarded", version, reason=f"trained on line {line}, "
                               f"abandoned since (now line {self.line})")
        self.kept.append(version)
        if self.pinned:
            return self._event("held", version, reason=f"pinned to version {self.incumbent}")
        if self.candidate is not None:
            if self.queued is not None:
                self._event("superseded", self.queued, by=version)
            self.queued = version
            return self._event("queued", version, behind=self.candidate)
        return self._start(version)

    def _start(self, version: int) -> dict[str, Any]:
        self.candidate, self.phase, self.queued = version, "shadow", None
        self.look, self.canary_started = 0, None
        self.arms = {"candidate": Arm(), "incumbent": Arm()}
        self.serving = {}
        return self._event("candidate", version, incumbent=self.incumbent)

    # ---- shadow evaluation -------------------------------------------------------------------

    def shadow_report(self, version: int, candidate_scores: list[float],
                      incumbent_scores: list[float], candidate_health: Any,
                      incumbent_health: Any) -> dict[str, Any]:
        """The shadow evaluation of ``version``: scores of the same held-out prompts (paired)
        and the health of both sides' replies (``health.Health``). Rejects or starts the
        canary."""
        if version != self.candidate or self.phase != "shadow":
            return self._event("ignored", version, reason="not the candidate in shadow "
                               f"evaluation (candidate {self.candidate}, phase {self.phase})")
        if len(candidate_scores) != len(incumbent_scores) or not candidate_scores:
            raise ValueError("shadow scores must pair the same prompts (same, non-zero length)")
        s = self.settings
        diffs = [c - i for c, i in zip(candidate_scores, incumbent_scores)]
        n = len(diffs)
        mean_c = sum(candidate_scores) / n
        mean_i = sum(incumbent_scores) / n
        mean_d = sum(diffs) / n
        se_d = (math.sqrt(sum((d - mean_d) ** 2 for d in diffs) / (n - 1) / n)
                if n > 1 else math.nan)
        evidence = {"n": n, "candidate_mean": mean_c, "incumbent_mean": mean_i,
                    "difference": mean_d, "difference_se": se_d,
                    "candidate_health": candidate_health.to_dict(),
                    "incumbent_health": incumbent_health.to_dict()}
        self.evidence.setdefault(version, {})["shadow"] = evidence
        if self.reference_readable is None:
            self.reference_readable = incumbent_health.readable_rate
        problems = health_problems(candidate_health, incumbent_health,
                                   min_readable=s.min_readable, max_empty=s.max_empty,
                                   max_length_ratio=s.max_length_ratio,
                                   max_broken_tool_calls=s.max_broken_tool_calls,
                                   reference_readable=self.reference_readable)
        first = self.reference_score is None  # the reference is this incumbent, just measured
        if first:
            self.reference_score = mean_i
        # lower by more than the margin, and significantly lower (one-sided paired t-test at
        # shadow_alpha): noise alone rejects a candidate as good as the incumbent at most
        # shadow_alpha of the time (measured: tests/unit/gate/test_significance.py)
        p_below = significance.paired_below(candidate_scores, incumbent_scores)
        p_below_ref = significance.below_value(candidate_scores, self.reference_score)
        half = significance.t_half_width(diffs, s.shadow_alpha)
        evidence.update(p_below=p_below, p_below_reference=p_below_ref,
                        significant_below=half)
        if mean_d < -s.shadow_margin and p_below < s.shadow_alpha:
            problems.append(f"held-out score {mean_c:.3f} against the incumbent's {mean_i:.3f} "
                            f"(lower by {-mean_d:.3f} > margin {s.shadow_margin:g}, "
                            f"significant: p = {p_below:.3g} < {s.shadow_alpha:g})")
        elif (not first and mean_c < self.reference_score - s.shadow_margin
              and p_below_ref < s.shadow_alpha):
            problems.append(f"held-out score {mean_c:.3f} against the reference's "
                            f"{self.reference_score:.3f} (lower by "
                            f"{self.reference_score - mean_c:.3f} > margin {s.shadow_margin:g}, "
                            f"significant: p = {p_below_ref:.3g} < {s.shadow_alpha:g})")
        if problems:
            return self._abandon(version, "rejected", "shadow: " + "; ".join(problems),
                                 evidence=evidence)
        self.phase, self.canary_started = "canary", self.clock()
        return self._event("canary", version, share=s.canary_share, evidence=evidence)

    def shadow_failed(self, version: int, reason: str) -> dict[str, Any] | None:
        """The shadow evaluation of ``version`` could not run (the caller retried): reject."""
        if version != self.candidate or self.phase != "shadow":
            return None
        return self._abandon(version, "rejected", f"shadow evaluation failed: {reason}")

    # ---- canary ------------------------------------------------------------------------------

    def route(self, session_key: str) -> int:
        """The version that serves ``session_key`` now (``routed_side`` of ``routing()``: the
        replicas route by the same rule on their mirror of that table)."""
        side = routed_side(self.routing(), session_key)
        return self.candidate if side == "candidate" else self.incumbent

    @property
    def salt(self) -> str:
        return f"canary-v{self.candidate}"

    def observe(self, version: int, reward: float, served_at: float | None = None,
                status: str = "judged") -> dict[str, Any] | None:
        """A judged turn (its reward) that ``version`` served at ``served_at``: counted when it
        is the candidate's or the incumbent's during the canary; may decide the canary.
        ``status``: judged | feedback (the user's own rating) | regenerated (the user asked
        again: its reward is the regenerate rule's)."""
        if self.phase != "canary" or not math.isfinite(reward):
            return None
        if served_at is not None and self.canary_started is not None \
                and served_at < self.canary_started:
            return None
        side = ("candidate" if version == self.candidate
                else "incumbent" if version == self.incumbent else None)
        if side is None:
            return None
        self.arms[side].add(float(reward), status)
        return self._canary_test()

    def serving_report(self, stats: dict[str, dict[str, float]]) -> dict[str, Any] | None:
        """The replicas' serving signals of the running canary (``merge_serving`` of their
        tallies for ``salt``): rolls the candidate back when a guard fails."""
        if self.phase != "canary" or self.candidate is None:
            return None
        self.serving = stats
        problems = self.guard_problems()
        if not problems:
            return None
        st = self.canary_stats()
        self.evidence.setdefault(self.candidate, {})["canary"] = st
        return self._abandon(self.candidate, "rolled_back", "canary: " + "; ".join(problems),
                             evidence=st)

    def guard_problems(self) -> list[str]:
        """The canary's guards beside the reward: the candidate's server-error rate, seconds
        per generated token and regenerate rate, each against the incumbent's over the same
        period; a guard fails when the candidate is worse beyond its allowance and
        significantly (one-sided, at ``canary_alpha / canary_looks``), with at least
        ``canary_min_turns`` on each side. Guards are checked at every report, without a
        correction for it: they err toward rolling back."""
        s = self.settings
        alpha = s.canary_alpha / s.canary_looks
        problems = []
        c, i = self.serving.get("candidate"), self.serving.get("incumbent")
        if c and i and min(c["requests"], i["requests"]) >= s.canary_min_turns:
            d = c["errors"] / c["requests"] - i["errors"] / i["requests"]
            p = significance.rate_higher(c["errors"], c["requests"], i["errors"], i["requests"])
            if d > s.canary_max_error_increase and p < alpha:
                problems.append(f"server errors {c['errors'] / c['requests']:.1%} against "
                                f"{i['errors'] / i['requests']:.1%} (higher by {d:.1%} > "
                                f"{s.canary_max_error_increase:.1%}, significant: p = {p:.3g})")
        if c and i and min(c["timed"], i["timed"]) >= s.canary_min_turns:
            w = significance.Welch(*_mean_var(c["s_per_token"], c["s_per_token_sq"], c["timed"]),
                                   c["timed"],
                                   *_mean_var(i["s_per_token"], i["s_per_token_sq"], i["timed"]),
                                   i["timed"])
            mc, mi = w.mean1, w.mean2
            if mi > 0 and mc / mi > s.canary_max_latency_ratio and (p := w.p_greater()) < alpha:
                problems.append(f"latency {mc * 1e3:.1f} ms per token against "
                                f"{mi * 1e3:.1f} ({mc / mi:.2f}x > "
                                f"{s.canary_max_latency_ratio:g}x, significant: p = {p:.3g})")
        a, b = self.arms["candidate"], self.arms["incumbent"]
        if min(a.n, b.n) >= s.canary_min_turns:
            d = a.regenerated / a.n - b.regenerated / b.n
            p = significance.rate_higher(a.regenerated, a.n, b.regenerated, b.n)
            if d > s.canary_max_regenerate_increase and p < alpha:
                problems.append(f"regenerated {a.regenerated / a.n:.1%} of turns against "
                                f"{b.regenerated / b.n:.1%} (higher by {d:.1%} > "
                                f"{s.canary_max_regenerate_increase:.1%}, significant: "
                                f"p = {p:.3g})")
        return problems

    def canary_stats(self) -> dict[str, Any]:
        c, i = self.arms["candidate"], self.arms["incumbent"]
        s = self.settings
        out: dict[str, Any] = {
            side: {"n": a.n, "mean": a.mean, "regenerated": a.regenerated,
                   "feedback": a.feedback,
                   "feedback_mean": a.feedback_total / a.feedback if a.feedback else None,
                   **({"serving": self.serving[side]} if side in self.serving else {})}
            for side, a in (("candidate", c), ("incumbent", i))}
        out.update(look=self.look, looks=s.canary_looks, margin=s.canary_margin)
        if c.n >= 2 and i.n >= 2:
            # Welch's t (scipy) at canary_alpha / canary_looks, one-sided each way
            w = significance.Welch(c.mean, c.var, c.n, i.mean, i.var, i.n)
            alpha = s.canary_alpha / s.canary_looks
            lower, upper = w.bounds(alpha)
            out.update(difference=w.difference, se=w.se, df=w.df, lower=lower, upper=upper,
                       p_non_inferior=w.p_greater(-s.canary_margin), p_worse=w.p_less(0.0))
        return out

    def _canary_test(self) -> dict[str, Any] | None:
        s = self.settings
        c, i = self.arms["candidate"], self.arms["incumbent"]
        if c.n < (self.look + 1) * s.canary_min_turns or i.n < s.canary_min_turns:
            return None
        self.look += 1
        st = self.canary_stats()
        self.evidence.setdefault(self.candidate, {})["canary"] = st
        version = self.candidate
        assert version is not None
        problems = self.guard_problems()
        if problems:
            return self._abandon(version, "rolled_back", f"canary: at look {self.look}: "
                                 + "; ".join(problems), evidence=st)
        alpha = s.canary_alpha / s.canary_looks
        if st["p_non_inferior"] < alpha:
            return self._promote(version, f"canary: non-inferior at look {self.look} (reward "
                                 f"{c.mean:+.3f} vs {i.mean:+.3f}, lower bound of the "
                                 f"difference {st['lower']:+.3f} > -{s.canary_margin:g})",
                                 evidence=st)
        if st["p_worse"] < alpha:
            return self._abandon(version, "rolled_back", f"canary: worse at look {self.look} "
                                 f"(reward {c.mean:+.3f} vs {i.mean:+.3f}, upper bound of "
                                 f"the difference {st['upper']:+.3f} < 0)", evidence=st)
        if self.look >= s.canary_looks:
            return self._abandon(version, "rolled_back", f"canary: not shown non-inferior "
                                 f"after {self.look} looks (lower bound {st['lower']:+.3f})",
                                 evidence=st)
        return self._event("look", version, evidence=st)

    # ---- decisions ---------------------------------------------------------------------------

    def _promote(self, version: int, reason: str, **extra: Any) -> dict[str, Any]:
        old = self.incumbent
        self.incumbent, self.candidate, self.phase = version, None, None
        ev = self._event("promoted", version, reason=reason, previous=old, **extra)
        if self.queued is not None:
            self._start(self.queued)
        return ev

    def _abandon(self, version: int, what: str, reason: str, **extra: Any) -> dict[str, Any]:
        """Reject (``what``: rejected | rolled_back) the candidate and every version after it
        (``on_reject="restart"``), or the candidate alone (``"keep_line"``: the queued version
        is the next candidate)."""
        if self.settings.on_reject == "keep_line":
            self.rejected.add(version)
            self.kept = [v for v in self.kept if v != version]
            queued, self.candidate, self.phase, self.queued = self.queued, None, None, None
            ev = self._event(what, version, reason=reason, abandoned=[], rejected=[version],
                             incumbent=self.incumbent, line=self.line, **extra)
            if queued is not None:
                self._start(queued)
            return ev
        gone = sorted(v for v in self.kept if v >= version and v != self.incumbent)
        self.abandoned.update(gone)
        self.kept = [v for v in self.kept if v not in self.abandoned]
        self.candidate, self.phase, self.queued = None, None, None
        self.line += 1
        return self._event(what, version, reason=reason, abandoned=gone,
                           incumbent=self.incumbent, line=self.line, **extra)

    # ---- the operator's side -----------------------------------------------------------------

    def promote(self, by: str = "operator") -> dict[str, Any]:
        if self.candidate is None:
            raise ValueError("no candidate to promote")
        return self._promote(self.candidate, f"{by}: promoted by hand")

    def reject(self, reason: str = "", by: str = "operator") -> dict[str, Any]:
        if self.candidate is None:
            raise ValueError("no candidate to reject")
        return self._abandon(self.candidate, "rejected",
                             f"{by}: rejected by hand" + (f" ({reason})" if reason else ""))

    def rollback(self, version: int, by: str = "operator", pin: bool = False
                 ) -> dict[str, Any]:
        """Serve kept ``version`` (or the base, 0) to everyone now; a pending candidate and
        every version after ``version`` are abandoned (the trainer restarts from it).
        ``pin``: hold there (new versions are kept but not tried) until ``unpin``."""
        if version != BASE and version not in self.kept:
            raise ValueError(f"version {version} is not kept (kept: {self.kept}; "
                             f"abandoned: {sorted(self.abandoned)})")
        old = self.incumbent
        later = sorted(v for v in self.kept if v > version)
        self.abandoned.update(later)
        self.kept = [v for v in self.kept if v not in self.abandoned]
        self.incumbent, self.candidate, self.phase, self.queued = version, None, None, None
        self.pinned = pin
        self.line += 1
        return self._event("pinned" if pin else "rolled_back", version,
                           reason=f"{by}: {'pinned' if pin else 'rolled back'} to version "
                           f"{version}", previous=old, abandoned=later, line=self.line)

    def unpin(self, by: str = "operator") -> dict[str, Any]:
        self.pinned = False
        return self._event("unpinned", self.incumbent, reason=f"{by}: unpinned")

    # ---- bookkeeping -------------------------------------------------------------------------

    def to_drop(self) -> list[int]:
        """Kept versions beyond ``keep`` (oldest first), never the incumbent, the candidate or
        the queued one; the caller deletes their payloads and calls ``dropped``."""
        busy = {self.incumbent, self.candidate, self.queued}
        spare = [v for v in self.kept if v not in busy]
        extra = len(self.kept) - self.settings.keep
        return spare[:max(0, extra)]

    def dropped(self, versions: list[int]) -> None:
        self.kept = [v for v in self.kept if v not in set(versions)]

    def routing(self) -> dict[str, Any]:
        """What replicas need to route a request: the incumbent's and candidate's adapters
        (None: the base model), the canary share and salt."""
        canary = self.phase == "canary" and self.candidate is not None
        return {"incumbent": self.incumbent,
                "incumbent_adapter": adapter_name(self.incumbent) if self.incumbent else None,
                "candidate": self.candidate if canary else None,
                "candidate_adapter": adapter_name(self.candidate) if canary else None,
                "share": self.settings.canary_share if canary else 0.0,
                "salt": self.salt if canary else ""}

    def status(self) -> dict[str, Any]:
        return {"incumbent": self.incumbent, "candidate": self.candidate, "phase": self.phase,
                "queued": self.queued, "pinned": self.pinned, "line": self.line,
                "kept": list(self.kept), "abandoned": sorted(self.abandoned),
                "rejected": sorted(self.rejected), "published": self.published,
                "on_reject": self.settings.on_reject,
                "canary": self.canary_stats() if self.phase == "canary" else None,
                "evidence": {v: self.evidence.get(v) for v in
                             (self.candidate, self.incumbent) if v in self.evidence},
                "routing": self.routing(), "events": self.events[-20:]}

    def _event(self, kind: str, version: int, **fields: Any) -> dict[str, Any]:
        self.event_seq += 1
        ev = {"seq": self.event_seq, "t": self.clock(), "event": kind, "version": version,
              **fields}
        self.events.append(ev)
        del self.events[:-200]
        return ev

    # ---- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"incumbent": self.incumbent, "candidate": self.candidate, "phase": self.phase,
                "queued": self.queued, "pinned": self.pinned, "line": self.line,
                "kept": self.kept, "abandoned": sorted(self.abandoned),
                "rejected": sorted(self.rejected), "published": self.published, "look": self.look, "event_seq": self.event_seq,
                "reference_readable": self.reference_readable,
                "reference_score": self.reference_score, "canary_started": self.canary_started,
                "serving": self.serving,
                "arms": {k: a.to_dict() for k, a in self.arms.items()},
                "evidence": {str(k): v for k, v in self.evidence.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], settings: GateSettings,
                  clock: Callable[[], float] = time.time) -> "GateCore":
        core = cls(settings=settings, clock=clock)
        for k in ("incumbent", "candidate", "phase", "queued", "pinned", "line", "kept",
                  "published", "look", "event_seq", "canary_started"):
            setattr(core, k, d[k])
        core.abandoned = set(d["abandoned"])
        core.rejected = set(d.get("rejected", ()))
        core.reference_readable = d.get("reference_readable")
        core.reference_score = d.get("reference_score")
        core.arms = {k: Arm(**a) for k, a in d["arms"].items()}
        core.serving = d.get("serving") or {}
        core.evidence = {int(k): v for k, v in d["evidence"].items()}
        return core


def _mean_var(total: float, total_sq: float, n: float) -> tuple[float, float]:
    mean = total / n
    return mean, max(0.0, (total_sq - total * total / n) / (n - 1)) if n > 1 else 0.0
