"""The publishing side of one weight channel: ``WeightPublisher`` owns the channel's version
sequence and runs each sync round in one process.

A round (``publish``): ``prepare(version + 1)`` on the channel's ``AppControl``, the learner's
rank 0 encodes its weights and puts the payload in the object store (``put_weights``: only the
payload is copied, where the weights are), the publisher publishes that reference and waits in
``finalize`` until every live replica serves the new version. Then everything that stamps rows
with the policy version (sample buffers) is told the new version. ``Trainer`` (the policy's
channel, the app's name) and ``RMCoTrainer`` (the JudgeServer's channel, ``{app}/judge``) use
the same class.

At start the publisher takes its place in the sequence the replicas already serve (versions
never go back), and refuses LoRA publishing onto replicas that serve fully trained weights:
they would merge adapters into weights that are not the learner's base model.

With ``transport="nccl"`` (``inference.weight_transfer: nccl``: vLLM replicas created with
vLLM's NCCL weight-transfer engine, GPU only) the learner's rank 0 broadcasts its weights
itself (``LearnerGroup.send_nccl``: ``VLLMNcclSync`` in ``clawray/weights/nccl.py``) and the
publisher waits for the replicas the same way; nothing goes through the object store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray

from clawray.weights.control import is_payload_box, start_app_control
from clawray.weights.nccl import check_nccl_available
from clawray.weights.sync import WeightSync, make_weight_sync


class WeightPublisher:
    """Version sequence and sync rounds of one channel (``channel``: an app or ``{app}/judge``).

    Create it before the learner (the LoRA check is cheap, learner ranks are not), then
    ``attach`` the learner: anything with ``put_weights(version)`` and ``set_version(version)``
    (a ``LearnerGroup``). ``followers`` are actor handles with ``set_policy_version`` (sample
    buffers), told each version once every replica serves it.
    """

    def __init__(self, channel: str, *, lora: bool, timeout_s: float = 120.0,
                 followers: Sequence[Any] = (), transport: str = "object_store",
                 ranks_per_replica: int = 1) -> None:
        self.channel = channel
        self.learner: Any = None
        self.timeout_s = timeout_s
        self.followers = list(followers)
        self.ranks_per_replica = ranks_per_replica
        if transport == "nccl":
            if lora:
                raise ValueError("the NCCL weight sync sends full weights, not LoRA adapters")
            check_nccl_available()  # before any learner is placed: a clear error on CPU
            kind = "nccl"
        elif transport == "object_store":
            kind = "lora" if lora else "object_store"
        else:
            raise ValueError(f"unknown weight transport {transport!r}: 'object_store' (the "
                             "replicas fetch from Ray's object store) or 'nccl' (vLLM, GPU)")
        self.control = start_app_control(channel)
        self.sync: WeightSync = make_weight_sync(kind, channel)
        status = self.status()
        published = int(status["version"])
        if lora and published and status.get("kind") != "lora":
            raise RuntimeError(
                f"{channel!r} serves full weights of version {published}: LoRA training needs "
                "its replicas to run the learner's base model (redeploy the app, or train "
                "without lora_rank)")
        self.version = published

    def attach(self, learner: Any) -> WeightPublisher:
        """Publish ``learner``'s weights from now on; a fresh learner takes the serving
        version's place in the sequence."""
        self.learner = learner
        if self.version:
            learner.set_version(self.version)
        return self

    def status(self) -> dict[str, Any]:
        """The channel's ``AppControl`` status (published version, kind, replicas)."""
        return ray.get(self.control.status.remote())

    def publish(self) -> dict[str, Any]:
        """Send the learner's weights as version + 1 and wait until every live replica serves
        them; returns the round's replicas, bytes and timings."""
        version = self.version + 1
        if self.sync.kind == "nccl":  # rank 0 checks, broadcasts from its GPU; replicas join
            sent = self.learner.send_nccl(version, self.channel, self.ranks_per_replica)
            info = self.sync.finalize(version, self.timeout_s)
            info.update(bytes=sent["bytes"], send_s=sent["seconds"],
                        seconds=sent["seconds"] + info["apply_s"])
            return self._published(version, info)
        self.sync.prepare(version)
        sent = self.learner.put_weights(version)
        if sent.get("kind") != self.sync.kind:
            raise RuntimeError(f"the learner sent {sent.get('kind')!r} weights to a "
                               f"{self.sync.kind!r} channel")
        self.sync.publish_ref(version, sent["payload"], int(sent["bytes"]),
                              float(sent["seconds"]))
        return self._published(version, self.sync.finalize(version, self.timeout_s))

    def publish_adapter(self, user: str, payload: Any, version: int, *, wait: bool = True,
                        min_replicas: int = 1) -> dict[str, Any]:
        """Per-user policies: publish ``user``'s adapter (a LoRA payload) at ``version`` beside
        the other users' (the channel's own version is not touched); with ``wait``, until every
        live replica serves it."""
        started = time.perf_counter()
        # a learner's ref, or the payload itself
        box = payload if is_payload_box(payload) else [ray.put(payload)]
        ray.get(self.control.publish_adapter.remote(user, version, box))
        replicas = ray.get(self.control.wait_adapter.remote(
            user, version, self.timeout_s, min_replicas)) if wait else {}
        return {"user": user, "version": version, "replicas": replicas,
                "seconds": time.perf_counter() - started}

    def delete_adapter(self, user: str, *, wait: bool = True) -> bool:
        """Replicas stop serving ``user``'s adapter (that user is served by the base)."""
        deleted = ray.get(self.control.delete_adapter.remote(user))
        if deleted and wait:
            ray.get(self.control.wait_adapter.remote(user, None, self.timeout_s, 0))
        return deleted

    def _published(self, version: int, info: dict[str, Any]) -> dict[str, Any]:
        self.version = version
        if self.followers:
            ray.get([f.set_policy_version.remote(version) for f in self.followers])
        return info

    def resume(self, saved: int) -> dict[str, Any] | None:
        """After the learner loaded a checkpoint of version ``saved``: when the replicas serve
        another version, republish the checkpoint's weights as the next one (never go back)."""
        published = int(self.status()["version"])
        self.version = max(saved, published)
        if published != saved:
            return self.publish()
        self.learner.set_version(saved)
        return None
