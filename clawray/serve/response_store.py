"""Server-side conversation state of the Responses API (``previous_response_id``).

Each stored response keeps only what it added to the conversation (its input items and its
output, as chat-template messages) and its parent's id, so a chain of n turns costs O(n), not
O(n²); the whole history is rebuilt by walking the chain. Entries belong to the tenant (API key)
that created them: another tenant's id is answered exactly like an unknown one. The store is
bounded (least recently used entries go first); a chain whose ancestor was evicted can no longer
be continued, and says so.

One store per app, shared by every ingress replica: a named, detached Ray actor
(``start_response_store``); without Ray (in-process tests and benchmarks) a local one.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import ray

from clawray.names import NAMESPACE, response_store_name


class ResponseStoreCore:
    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self.entries: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def put(self, response_id: str, tenant: str, parent: str | None,
            messages: list[dict[str, Any]], session_id: str | None,
            body: dict[str, Any]) -> None:
        self.entries[response_id] = {"tenant": tenant, "parent": parent, "messages": messages,
                                     "session_id": session_id, "body": body}
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def history(self, response_id: str, tenant: str) -> dict[str, Any]:
        """The conversation up to and including ``response_id``: ``{"messages",
        "session_id"}``; ``{"error": "not_found" | "expired"}`` when it cannot be rebuilt."""
        chain, rid = [], response_id
        while rid is not None:
            entry = self.entries.get(rid)
            if entry is None or entry["tenant"] != tenant:
                return {"error": "not_found" if rid == response_id else "expired"}
            chain.append((rid, entry))
            rid = entry["parent"]
        for rid, _ in reversed(chain):  # the tip ends up the most recently used
            self.entries.move_to_end(rid)
        messages = [m for _, entry in reversed(chain) for m in entry["messages"]]
        return {"messages": copy.deepcopy(messages), "session_id": chain[0][1]["session_id"]}

    def get(self, response_id: str, tenant: str) -> dict[str, Any] | None:
        entry = self.entries.get(response_id)
        if entry is None or entry["tenant"] != tenant:
            return None
        return copy.deepcopy(entry["body"])

    def delete(self, response_id: str, tenant: str) -> bool:
        entry = self.entries.get(response_id)
        if entry is None or entry["tenant"] != tenant:
            return False
        del self.entries[response_id]
        return True

    def __len__(self) -> int:
        return len(self.entries)


@ray.remote(num_cpus=0)
class ResponseStore(ResponseStoreCore):
    """The app's store as an actor (same methods)."""


class LocalStore:
    """The same interface, awaited, without Ray."""

    def __init__(self, max_entries: int) -> None:
        self.core = ResponseStoreCore(max_entries)

    async def put(self, *args: Any) -> None:
        self.core.put(*args)

    async def history(self, response_id: str, tenant: str) -> dict[str, Any]:
        return self.core.history(response_id, tenant)

    async def get(self, response_id: str, tenant: str) -> dict[str, Any] | None:
        return self.core.get(response_id, tenant)

    async def delete(self, response_id: str, tenant: str) -> bool:
        return self.core.delete(response_id, tenant)


class ActorStore:
    """Awaitable calls on the app's ``ResponseStore`` actor."""

    def __init__(self, app_name: str, max_entries: int) -> None:
        self.actor = ResponseStore.options(
            name=response_store_name(app_name), namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", max_restarts=-1, max_task_retries=-1).remote(max_entries)

    async def put(self, *args: Any) -> None:
        await self.actor.put.remote(*args)

    async def history(self, response_id: str, tenant: str) -> dict[str, Any]:
        return await self.actor.history.remote(response_id, tenant)

    async def get(self, response_id: str, tenant: str) -> dict[str, Any] | None:
        return await self.actor.get.remote(response_id, tenant)

    async def delete(self, response_id: str, tenant: str) -> bool:
        return await self.actor.delete.remote(response_id, tenant)


def start_response_store(app_name: str, max_entries: int) -> LocalStore | ActorStore:
    if ray.is_initialized():
        return ActorStore(app_name, max_entries)
    return LocalStore(max_entries)
