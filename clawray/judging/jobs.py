"""What the session hub asks of the judges (``JudgeJob``) and what they answer (``Verdict``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from clawray.records import TurnRecord


@dataclasses.dataclass
class JudgeJob:
    """A turn with its next state, to be judged by the PRM voters."""

    job_id: int
    session_id: str
    record: TurnRecord
    history: list[dict[str, Any]]
    request: list[dict[str, Any]]
    next_state: list[dict[str, Any]]
    hint_messages: list[dict[str, Any]]  # the student's prompt messages, as served


@dataclasses.dataclass
class Verdict:
    """What the judges said about one turn (``votes`` holds None for a parse failure)."""

    status: str  # judged | unjudged
    votes: list[int | None] = dataclasses.field(default_factory=list)
    hint: str | None = None
    teacher_logprobs: list[float] | None = None
    error: str | None = None

    @property
    def valid_votes(self) -> list[int]:
        return [v for v in self.votes if v is not None]
