"""API-key check for the public endpoint: constant-time, over every configured key.

Each key is a tenant: the check returns the tenant id of the key that matched, and every
session, turn record and feedback call of a request lives in that tenant's namespace
(``clawray/serve/session_meta.py``), so one key holder can never address, end or rate another's
sessions. A tenant id is a fingerprint of its key (``key-`` and the first 12 hex digits of its
SHA-256): stable across restarts, the same on every replica, and it does not reveal the key.
Without keys (auth off, loopback only) every request is the tenant ``local``.

The checker holds SHA-256 digests, never keys: the presented key is hashed and its digest
compared, so deployments receive digests in their init args (``build_app``) and a key never
appears in ``serve status``, the dashboard or a log.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping

from clawray.serve.protocol import APIError

LOCAL_TENANT = "local"


def tenant_of_key(key: str) -> str:
    """The tenant id of an API key (what records and logs carry instead of the key)."""
    return tenant_of_digest(hashlib.sha256(key.encode()).hexdigest())


def tenant_of_digest(digest: str) -> str:
    return "key-" + digest[:12]


class KeyChecker:
    """Accepts ``Authorization: Bearer <key>`` or ``x-api-key: <key>``.

    With no keys configured, auth is off (the config refuses that beyond loopback). The
    comparison runs ``hmac.compare_digest`` against every key without stopping early, so the
    time taken does not reveal which key (or how much of one) matched.
    """

    def __init__(self, digests: list[str]) -> None:
        """``digests``: SHA-256 hex digests of the accepted keys
        (``ServingConfig.key_digests``)."""
        self._keys = [bytes.fromhex(d) for d in digests]
        self._tenants = [tenant_of_digest(d.lower()) for d in digests]

    @classmethod
    def of_keys(cls, keys: list[str]) -> "KeyChecker":
        return cls([hashlib.sha256(k.encode()).hexdigest() for k in keys])

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, headers: Mapping[str, str]) -> str:
        """The tenant of the request's key; raises a 401 ``APIError`` without a valid key."""
        if not self._keys:
            return LOCAL_TENANT
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if not given:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="missing_api_key")
        given_b = hashlib.sha256(given.encode()).digest()
        matched = -1
        for i, key in enumerate(self._keys):
            equal = hmac.compare_digest(given_b, key)
            matched = max(matched, i * equal - (not equal))  # no early exit, no branch on it
        if matched < 0:
            raise APIError(401, "incorrect API key provided", type="authentication_error",
                           code="invalid_api_key")
        return self._tenants[matched]
