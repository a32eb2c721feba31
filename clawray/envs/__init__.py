"""Verifiable text environments (protocol in ``base.py``) and how a config names them.

``make_family(name, **kwargs)`` accepts a built-in name (``household``, ``tool_use``),
``gym:<env id>`` for any gymnasium environment with text observations, or an import path
``package.module:attr`` to a ``TaskFamily`` subclass or factory (a user's own environment).
"""

from __future__ import annotations

import importlib
from typing import Any

from clawray.envs.base import (POOLS, Action, Demonstration, EnvError, Param, Pooled,
                               StepResult, Task, TaskFamily, TextEnv, demo_tasks, demonstrate,
                               task_pool)

BUILTIN = {
    "household": "clawray.envs.household:HouseholdFamily",
    "tool_use": "clawray.envs.tool_use:ToolUseFamily",
}


def _import(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise EnvError(f"environment {path!r}: expected a built-in name ({', '.join(BUILTIN)}), "
                       "'gym:<env id>' or an import path 'package.module:attr'")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise EnvError(f"environment {path!r}: cannot import {module!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"environment {path!r}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def make_family(name: str, **kwargs: Any) -> TaskFamily:
    """The task family a config names (see the module docstring)."""
    if name.startswith("gym:"):
        from clawray.envs.gym import GymTextFamily

        return GymTextFamily(name[len("gym:"):], **kwargs)
    factory = _import(BUILTIN.get(name, name))
    family = factory(**kwargs)
    if not isinstance(family, TaskFamily):
        raise EnvError(f"environment {name!r} built a {type(family).__name__}, not a "
                       "clawray.envs.TaskFamily")
    return family


__all__ = ["Action", "BUILTIN", "Demonstration", "demo_tasks", "EnvError", "Param", "POOLS", "Pooled",
           "StepResult", "Task", "task_pool",
           "TaskFamily", "TextEnv", "demonstrate", "make_family"]
