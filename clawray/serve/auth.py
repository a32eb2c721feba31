"""API-key check for the public endpoint: constant-time, over every configured key."""

from __future__ import annotations

import hmac
from typing import Mapping

from clawray.serve.protocol import APIError


class KeyChecker:
    """Accepts ``Authorization: Bearer <key>`` or ``x-api-key: <key>``.

    With no keys configured, auth is off (the config refuses that beyond loopback). The
    comparison runs ``hmac.compare_digest`` against every key without stopping early, so the
    time taken does not reveal which key (or how much of one) matched.
    """

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, headers: Mapping[str, str]) -> None:
        if not self._keys:
            return
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if not given:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="missing_api_key")
        given_b = given.encode()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given_b, key)
        if not ok:
            raise APIError(401, "incorrect API key provided", type="authentication_error",
                           code="invalid_api_key")
