"""The curriculum actor: ``Curriculum`` (``clawray/curriculum/core.py``) as a named Ray actor
that env runners share, restarting from its checkpoint."""

from __future__ import annotations

from typing import Any

import ray

from clawray.curriculum.core import Curriculum
from clawray.names import NAMESPACE


@ray.remote(num_cpus=0)
class CurriculumActor(Curriculum):
    """``Curriculum`` as a Ray actor (methods run one at a time, so no locking)."""

    def ping(self) -> str:
        return "pong"


def get_or_create_curriculum(name: str, namespace: str = NAMESPACE,
                             runtime_env: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """The named curriculum actor (created with ``Curriculum(**kwargs)`` if missing; an
    existing one keeps its settings). It is owned by the caller (not detached).

    It restarts forever and re-runs its constructor, so it resumes from ``checkpoint_path``
    (without one it starts afresh). Calls are retried through a restart
    (``max_task_retries=-1``), which is safe here: a retried ``report`` applies at most once
    (a lease closes when reported, and the restored state only holds leases not yet reported
    at the checkpoint); a retried ``lease`` hands out new leases, and those of the lost reply
    were made after the last checkpoint (checkpoints are written by later calls, which run
    after the reply was sent), so they vanished with the crash.
    """
    return CurriculumActor.options(
        name=name, namespace=namespace, get_if_exists=True, num_cpus=0, max_restarts=-1,
        max_task_retries=-1, runtime_env=runtime_env,
    ).remote(**kwargs)
