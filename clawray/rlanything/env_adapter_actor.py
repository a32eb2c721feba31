"""``EnvAdapter``: the environment adapter's core (``EnvAdapterCore`` in
``clawray/rlanything/env_adapter.py``) as a named async Ray actor, checkpointed and restarting
from its checkpoint like the curriculum actor."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import ray

from clawray.names import NAMESPACE
from clawray.rlanything.env_adapter import AdapterConfig, EnvAdapterCore, build_family

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class EnvAdapter:
    """``EnvAdapterCore`` as an async Ray actor: an LLM rewrite awaits its backend without
    blocking the actor; a lock keeps one call at a time on the state (``metrics`` excepted)."""

    def __init__(self, family_name: str, family_kwargs: dict[str, Any] | None = None,
                 checkpoint_path: str | None = None, checkpoint_every: int = 1,
                 llm_rewrite: dict[str, Any] | None = None, judge_handle: Any = None,
                 pool: str | None = None, **settings: Any) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        family = build_family(family_name, family_kwargs, llm_rewrite, judge_handle, pool)
        config = AdapterConfig(**settings)
        self.checkpoint_path, self.checkpoint_every = checkpoint_path, checkpoint_every
        if checkpoint_path and Path(checkpoint_path).exists():
            self.core = EnvAdapterCore.load(checkpoint_path, family)
            if self.core.config != config:
                logger.warning("env adapter settings %s differ from the checkpoint's %s; the "
                               "checkpoint's are kept", config, self.core.config)
            logger.info("env adapter restored from %s at step %d", checkpoint_path,
                        self.core.step)
        else:
            self.core = EnvAdapterCore(family, config)
        self._lock = asyncio.Lock()

    async def ping(self) -> str:
        return "pong"

    async def tasks_for_step(self) -> list[dict[str, Any]]:
        async with self._lock:
            return self.core.tasks_for_step()

    async def report(self, results: list[dict[str, Any]],
                     step_id: int | None = None) -> dict[str, Any]:
        async with self._lock:
            out = await self.core.areport(results, step_id)
            if self.checkpoint_path and self.checkpoint_every \
                    and self.core.counts["reports"] % self.checkpoint_every == 0:
                self.core.save(self.checkpoint_path)
            return out

    async def metrics(self) -> dict[str, Any]:
        return self.core.metrics()

    async def state(self) -> dict[str, Any]:
        async with self._lock:
            return self.core.state()

    async def save(self, path: str | None = None) -> str:
        path = path or self.checkpoint_path
        if not path:
            raise ValueError("no checkpoint path: pass one to save() or to the constructor")
        async with self._lock:
            return self.core.save(path)


def get_or_create_env_adapter(name: str, namespace: str = NAMESPACE,
                              runtime_env: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """The named env adapter actor (created with ``EnvAdapter(**kwargs)`` if missing; an
    existing one keeps its settings), owned by the caller.

    It restarts forever and resumes from ``checkpoint_path``. Calls are retried through a
    restart (``max_task_retries=-1``): ``tasks_for_step`` only reads, and a retried ``report``
    that carries a ``step_id`` returns the saved answer if the checkpoint already holds it
    (with ``checkpoint_every=1``, the default, every report is saved before it returns).
    """
    return EnvAdapter.options(
        name=name, namespace=namespace, get_if_exists=True, num_cpus=0, max_restarts=-1,
        max_task_retries=-1, runtime_env=runtime_env,
    ).remote(**kwargs)
