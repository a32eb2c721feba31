"""Verifiable text environments (protocol in ``base.py``) and how a config names them.

``make_family(name, **kwargs)`` accepts a built-in name (``household``, ``tool_use``),
``gym:<env id>`` for any gymnasium environment with text observations, or an import path
``package.module:attr`` to a ``TaskFamily`` subclass or factory (a user's own environment).
"""

from __future__ import annotations

import pkgutil
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
    try:
        if not module or not attr:
            raise ValueError(path)
        return pkgutil.resolve_name(path)
    except ImportError as e:
        raise EnvError(f"environment {path!r}: cannot import {module!r}: {e}") from None
    except AttributeError:
        raise EnvError(f"environment {path!r}: {module!r} has no attribute {attr!r}") from None
    except ValueError as e:  # resolve_name: not identifiers
        raise EnvError(f"environment {path!r}: expected a built-in name ({', '.join(BUILTIN)}), "
                       "'gym:<env id>' or an import path 'package.module:attr'") from e


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
