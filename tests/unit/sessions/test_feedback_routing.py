"""``first_known``: feedback by response id asks every session hub; the hub that holds the turn
answers it without waiting for the others, and a hub that does not answer (restarting, or on a
lost host) makes it a retryable error, never a hang."""

from __future__ import annotations

import asyncio

import pytest

from clawray.sessions.pipeline import HubUnavailable, first_known


async def answer(status: str, after_s: float = 0.0) -> dict:
    await asyncio.sleep(after_s)
    return {"status": status, "hub_delay": after_s}


async def never() -> dict:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def test_the_hub_that_knows_the_turn_answers_without_waiting_for_a_silent_one():
    # waiting for every hub would end in HubUnavailable: the silent one never answers
    r = asyncio.run(first_known([never(), answer("unknown"), answer("applied", 0.05)], 2.0))
    assert r["status"] == "applied"


def test_sealed_is_an_answer_too():
    r = asyncio.run(first_known([answer("unknown"), answer("sealed", 0.01)], 5.0))
    assert r["status"] == "sealed"


def test_unknown_once_every_hub_said_so():
    r = asyncio.run(first_known([answer("unknown"), answer("unknown", 0.01)], 5.0))
    assert r["status"] == "unknown"


def test_a_silent_hub_and_no_answer_is_retryable():
    with pytest.raises(HubUnavailable, match="1 of 2 session hubs did not answer within 0.2 s"):
        asyncio.run(first_known([answer("unknown"), never()], 0.2))


def test_a_hub_that_fails_raises_its_error():
    async def broken() -> dict:
        raise RuntimeError("hub died")

    with pytest.raises(RuntimeError, match="hub died"):
        asyncio.run(first_known([broken()], 5.0))
