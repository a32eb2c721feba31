"""Simulated users with a hidden, measurable preference, driving clawray through its HTTP API.

``preferences.py`` holds the preferences (pure Python), ``users.py`` the users, the session
driver and the side-turn evaluation; ``python -m clawray.sim`` runs them from a shell.
"""

from clawray.sim.preferences import (PREFERENCES, BriefReplies, DetailedReplies, Preference,
                                     get_preference)
from clawray.sim.users import (EvalResult, Interaction, SimUser, evaluate, make_request,
                               parse_policy_version, run_users, satisfaction_rate)

__all__ = ["PREFERENCES", "BriefReplies", "DetailedReplies", "EvalResult", "Interaction", "Preference", "SimUser",
           "evaluate", "get_preference", "make_request", "parse_policy_version", "run_users",
           "satisfaction_rate"]
