"""Session metadata of a request: which session, which turn type, whether the session ended.

Sources, first match wins (OpenClaw-RL's protocol plus OpenClaw's session-affinity option):

- session id: ``X-Session-Id`` header, ``session_id`` body field, ``session_id`` header,
  ``x-session-affinity`` header, ``prompt_cache_key`` body field, the session of the
  Responses chain that ``previous_response_id`` continues; without any, a stable key
  derived from the conversation's first system and user messages (the history is resent each
  turn, so every turn of a conversation maps to the same key, and two conversations never share
  one bucket).
- turn type: ``X-Turn-Type`` header or ``turn_type`` body field; ``main`` is trainable,
  anything else is a side turn; default from ``serving.default_turn_type``.
- session done: ``X-Session-Done`` header or ``session_done`` body field, true for
  1/true/yes/on (any case).
- retry: the client says the request repeats an earlier one (the OpenAI SDKs send
  ``x-stainless-retry-count``; ``X-Retry: 1`` works for others). A retry is never taken for the
  user regenerating a reply.
- user: OpenAI's ``user`` body field or an ``X-User-Id`` header, for apps that serve many end
  users through one API key (a proxy): each user's sessions are a namespace of their own.
- policy user (whose policy serves the turn and learns from it, per-user policies): the end user
  (``"<tenant>/<user>"``) when the key is a trusted app's (``serving.trusted_app_tenants``, or
  no auth at all), else the key's tenant: a key that is not trusted cannot pick another user's
  policy by naming a user, it only namespaces its sessions.

Namespaces: every session lives in the namespace of the request's tenant (its API key, see
``auth.py``) and user. The session pipeline keys sessions by ``SessionMeta.key`` (namespace +
session id), so a client can address, end and rate only the sessions its own key created, and two
tenants (or two users of one tenant) that send the same session id, or open with the same
messages, never share a session. Records keep the client's session id next to tenant and user.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

from clawray.records import session_key
from clawray.serve.protocol import MAX_ID_CHARS, APIError

_TRUE = {"1", "true", "yes", "on"}


@dataclasses.dataclass(frozen=True)
class SessionMeta:
    session_id: str
    source: str
    turn_type: str
    session_done: bool
    retry: bool = False
    tenant: str = "local"
    user: str | None = None
    policy_user: str = "local"

    @property
    def key(self) -> str:
        """The session's key in the pipeline: unique across tenants and users."""
        return session_key(self.tenant, self.user, self.session_id)


def session_meta(
    headers: Mapping[str, str],
    body_fields: Mapping[str, Any],
    messages: list[dict[str, Any]],
    default_turn_type: str,
    tenant: str = "local",
    trusted_app: bool = False,
) -> SessionMeta:
    """Resolve the metadata of one request; ``headers`` must be case-insensitive."""
    candidates = [
        ("header", headers.get("x-session-id")),
        ("body", body_fields.get("session_id")),
        ("header", headers.get("session_id")),
        ("affinity", headers.get("x-session-affinity")),
        ("prompt_cache_key", body_fields.get("prompt_cache_key")),
        # the Responses API: the session of the chain ``previous_response_id`` continues
        ("previous_response", body_fields.get("chain_session_id")),
    ]
    session_id, source = None, "derived"
    for src, value in candidates:
        if value not in (None, ""):
            session_id, source = str(value), src
            break
    user = body_fields.get("user") or headers.get("x-user-id") or None
    user = str(user) if user is not None else None
    for name, value in (("session id", session_id), ("user", user)):
        if value is not None and len(value) > MAX_ID_CHARS:
            raise APIError(400, f"the {name} is longer than {MAX_ID_CHARS} characters",
                           param="session_id" if name == "session id" else "user")
    if session_id is None:
        session_id = derive_session_key(messages, tenant, user)

    turn_type = headers.get("x-turn-type") or body_fields.get("turn_type") or default_turn_type
    turn_type = str(turn_type).strip().lower()
    if turn_type != "main":
        turn_type = "side"

    done_raw = headers.get("x-session-done", body_fields.get("session_done", False))
    retry_count = str(headers.get("x-stainless-retry-count", "0")).strip()
    retry = (retry_count.isdigit() and int(retry_count) > 0) or _truthy(headers.get("x-retry", ""))
    return SessionMeta(session_id, source, turn_type, _truthy(done_raw), retry, tenant, user,
                       policy_user_of(tenant, user, trusted_app))


def addressed_user(served_model: str, model: str | None, fields: Mapping[str, Any], tenant: str,
                   trusted_app: bool) -> Mapping[str, Any]:
    """The session fields a request's ``model`` implies. ``"<served model>"`` (or none):
    ``fields`` as they are. ``"<served model>:<user>"`` (Ray Serve LLM's adapter naming)
    addresses that user's policy, allowed only for the caller's own: a trusted app (or the local
    operator) names one of its end users (as with ``user``; the two must agree), any other key
    only its own tenant id (``clawray key-digest``)."""
    if model in (None, "", served_model):
        return fields
    prefix = f"{served_model}:"
    who = str(model)[len(prefix):] if str(model).startswith(prefix) else ""
    if not who:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{served_model}' (or '{prefix}<user>' for your own user's policy)",
                       param="model", code="model_not_found")
    if len(who) > MAX_ID_CHARS:
        raise APIError(400, f"the user in model is longer than {MAX_ID_CHARS} characters",
                       param="model")
    if trusted_app:
        named = fields.get("user")
        if named not in (None, "") and str(named) != who:
            raise APIError(400, f"model names user '{who}' but user is '{named}': they must "
                           "agree", param="model")
        return {**fields, "user": who}
    if who != tenant:
        raise APIError(403, "a key may address only its own policy: model "
                       f"'{served_model}:<your tenant id>' (clawray key-digest)",
                       type="permission_error", param="model", code="model_not_permitted")
    return fields


def policy_user_of(tenant: str, user: str | None, trusted_app: bool) -> str:
    """Whose policy a request of ``tenant`` naming ``user`` is served by and trains."""
    return f"{tenant}/{user}" if user and trusted_app else tenant


def derive_session_key(messages: list[dict[str, Any]], tenant: str = "local",
                       user: str | None = None) -> str:
    """A stable key from the first system message and the first user message, of this tenant
    and user (two tenants whose conversations open alike get different keys)."""
    first_system = next((m for m in messages if m["role"] == "system"), None)
    first_user = next((m for m in messages if m["role"] == "user"), None)
    basis = json.dumps(
        [
            first_system["content"] if first_system else None,
            first_user["content"] if first_user else None,
            tenant,
            user,
        ],
        ensure_ascii=False,
    )
    return "derived-" + hashlib.sha256(basis.encode()).hexdigest()[:20]


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in _TRUE
