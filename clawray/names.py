"""The Ray namespace of clawray's named actors and the names they go by, in one place.

Every named actor of an app lives in ``NAMESPACE``; a job attaches to one by the name built
here (``ray.get_actor(control_name(app), namespace=NAMESPACE)``)."""

from __future__ import annotations

NAMESPACE = "clawray"


def control_name(app: str) -> str:
    """The ``AppControl`` actor of a weight channel (an app, or ``judge_channel(app)``)."""
    return f"{app}:control"


def judge_channel(app: str) -> str:
    """The weight channel of ``app``'s JudgeServer replicas (the RLAnything RM)."""
    return f"{app}/judge"


def gate_name(app: str) -> str:
    """The app's ``PolicyGate``."""
    return f"{app}:gate"


def buffer_name(app: str) -> str:
    """The live pipeline's ``SampleBuffer``."""
    return f"{app}:buffer"


def voter_name(app: str, i: int) -> str:
    """The live pipeline's ``i``-th ``PRMVoter``."""
    return f"{app}:voter:{i}"


def hub_name(app: str, i: int) -> str:
    """The live pipeline's ``i``-th ``SessionHub``."""
    return f"{app}:hub:{i}"


def env_buffer_name(app: str, suffix: str) -> str:
    """The environments' ``SampleBuffer`` (``environments.buffer_suffix``)."""
    return f"{app}:{suffix}"


def curriculum_name(app: str) -> str:
    """The environments' ``CurriculumActor``."""
    return f"{app}:curriculum"


def env_adapter_name(app: str) -> str:
    """RLAnything's ``EnvAdapter``."""
    return f"{app}:env-adapter"


def rm_buffer_name(app: str) -> str:
    """RLAnything's ``SampleBuffer`` of reward-model rows."""
    return f"{app}:rm-buffer"


def response_store_name(app: str) -> str:
    """The Responses API's ``ResponseStore`` (``previous_response_id`` state)."""
    return f"{app}-responses"
