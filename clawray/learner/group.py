"""``LearnerGroup``: DeepSpeed data-parallel ranks as Ray actors on one placement group.

Each rank is a ``LearnerWorker`` actor holding a ``LearnerCore``. Rank 0 picks the rendezvous
address (its node's IP and a free port); every rank then joins the process group (gloo on CPU,
nccl on GPU). ``update`` hands every rank the same list of buffer slices: each resolves the
batch objects from the object store (zero-copy on the same node) and trains on its share of
the rows, and DeepSpeed averages the gradients. The bundles follow
``training.placement_strategy``: ``PACK`` keeps ranks together, ``SPREAD``/``STRICT_SPREAD``
put them on different nodes.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from clawray.buffer.core import Slice, fetch
from clawray.config import PartPlacement, TrainingConfig
from clawray.learner.adapters import AdapterStore, UserAdapters, restart_lora
from clawray.learner.learner import LearnerCore, combine_rank_metrics, init_distributed
from clawray.weights.sync import make_weight_sync

logger = logging.getLogger(__name__)


RENDEZVOUS_ATTEMPTS = 3


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LearnerWorker:
    """One DeepSpeed rank (a Ray actor: ``ray.remote(LearnerWorker)``)."""

    def __init__(self, model_path: str, training: dict[str, Any], rank: int,
                 world_size: int) -> None:
        self.model_path = model_path
        self.cfg = TrainingConfig.model_validate(training)
        self.rank, self.world_size = rank, world_size
        self._nccl: Any = None  # rank 0's VLLMNcclSync, once the NCCL sync is used
        self._adapters: Any = None  # UserAdapters, once per-user training is used
        self.core: LearnerCore | None = None

    def rendezvous(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master_addr: str, master_port: int) -> str:
        init_distributed(self.rank, self.world_size, master_addr, master_port)
        self.core = LearnerCore(self.model_path, self.cfg, self.rank, self.world_size)
        return ray.util.get_node_ip_address()

    def _core(self) -> LearnerCore:
        if self.core is None:
            raise RuntimeError("LearnerWorker.setup() was not called")
        return self.core

    def update(self, batch: Sequence[Slice] | pa.Table) -> dict[str, float]:
        table = batch if isinstance(batch, pa.Table) else fetch(batch, ray.get)
        return self._core().update(table)

    def logprobs(self, table: pa.Table) -> list[list[float]]:
        return self._core().logprobs(table)

    def sync_payload(self) -> tuple[str, dict[str, Any]]:
        return self._core().sync_payload()

    def put_weights(self, version: int) -> dict[str, Any]:
        """Encode this rank's weights as ``version``'s payload and put it in the object store
        (rank 0's result counts; other ranks only take part in a ZeRO-3 gather). The payload
        ref comes back in a one-element list; a ``WeightPublisher`` publishes it."""
        started = time.perf_counter()
        kind, state = self._core().sync_payload()
        self._core().policy_version = version
        if self.rank != 0:
            return {}
        kind = "lora" if kind == "lora" else "object_store"
        payload, nbytes = make_weight_sync(kind).encode(state)
        ref = ray.put(payload)
        return {"kind": kind, "payload": [ref], "bytes": nbytes,
                "seconds": time.perf_counter() - started}

    def send_nccl(self, version: int, app: str, ranks_per_replica: int) -> dict[str, Any]:
        """Broadcast this rank's weights as ``version`` into ``app``'s vLLM replicas over NCCL
        (rank 0 is the group's sender; other ranks only join a ZeRO-3 gather). The sync object
        lives on rank 0 between rounds: its NCCL group is reused while the replicas stay."""
        from clawray.weights.nccl import VLLMNcclSync

        kind, state = self._core().sync_payload(on_device=True)
        self._core().policy_version = version
        if self.rank != 0:
            return {}
        if kind != "full":
            raise RuntimeError("the NCCL weight sync sends full weights, not LoRA adapters")
        if self._nccl is None or self._nccl.app_name != app:
            self._nccl = VLLMNcclSync(app, ranks_per_replica=ranks_per_replica)
        self._nccl.prepare(version)
        sent = self._nccl.send(state, version)
        return {"kind": "nccl", "bytes": int(sent["bytes"]), "seconds": float(sent["seconds"])}

    def set_version(self, version: int) -> None:
        self._core().policy_version = version

    def update_user(self, user: str, batch: Sequence[Slice] | pa.Table) -> dict[str, Any]:
        """Per-user policies: one update of ``user``'s adapter on their rows; with the
        adapter's payload put in the object store (``{"payload": [ref]}``) for
        ``WeightPublisher.publish_adapter``."""
        if self._adapters is None:
            self._adapters = UserAdapters(self._core(), AdapterStore(self.cfg.user_adapters_dir))
        table = batch if isinstance(batch, pa.Table) else fetch(batch, ray.get)
        metrics = self._adapters.update(user, table)
        return {"metrics": metrics, "version": int(metrics["version"]),
                "payload": [ray.put(self._adapters.payload(user))]}

    def restart_lora(self, payload_box: list | None) -> int:
        """Set the LoRA adapter to ``payload_box[0]``'s payload (None: the base) and forget
        its optimizer moments (``clawray.learner.adapters.restart_lora``; the policy gate)."""
        return restart_lora(self._core(), ray.get(payload_box[0]) if payload_box else None)

    def stored_adapters(self) -> dict[str, int]:
        """Per-user policies: every user with an adapter on disk, and its version."""
        return {m["user"]: int(m["version"])
                for m in AdapterStore(self.cfg.user_adapters_dir).users()}

    def adapter_payload(self, user: str) -> list[Any]:
        """``user``'s stored adapter as a LoRA payload in the object store (``[ref]``)."""
        if self._adapters is None:
            self._adapters = UserAdapters(self._core(), AdapterStore(self.cfg.user_adapters_dir))
        return [ray.put(self._adapters.payload(user))]

    def save(self, path: str, client_state: dict[str, Any]) -> None:
        self._core().save(path, client_state)

    def load(self, path: str) -> dict[str, Any]:
        return self._core().load(path)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def ping(self) -> str:
        return "pong"


class LearnerGroup:
    """``num_learners`` DeepSpeed ranks; every call goes to all of them."""

    def __init__(self, model_path: str | Path, cfg: TrainingConfig,
                 setup_timeout_s: float = 600.0, placement: PartPlacement | None = None
                 ) -> None:
        """``placement``: custom resources and node labels of each rank's bundle
        (``placement.learner``)."""
        self.cfg = cfg
        n = cfg.num_learners
        bundle: dict[str, float] = {"CPU": cfg.learner_num_cpus}
        if cfg.learner_num_gpus:
            bundle["GPU"] = cfg.learner_num_gpus
        if placement is not None:
            bundle.update(placement.resources)
        labels = dict(placement.labels) if placement is not None else {}
        self.pg = placement_group([dict(bundle) for _ in range(n)],
                                  strategy=cfg.placement_strategy,
                                  **({"bundle_label_selector": [labels] * n} if labels else {}))
        try:
            ray.get(self.pg.ready(), timeout=setup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"the cluster cannot place {n} learner(s) of {bundle} with strategy "
                f"{cfg.placement_strategy} within {setup_timeout_s:.0f} s") from None
        actor = ray.remote(LearnerWorker)
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            self.workers = [
                actor.options(
                    num_cpus=cfg.learner_num_cpus, num_gpus=cfg.learner_num_gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=i),
                ).remote(str(model_path), cfg.model_dump(mode="json"), i, n)
                for i in range(n)
            ]
            addr, port = ray.get(self.workers[0].rendezvous.remote(), timeout=setup_timeout_s)
            try:
                self.nodes = ray.get([w.setup.remote(addr, port) for w in self.workers],
                                     timeout=setup_timeout_s)
                break
            except ray.exceptions.RayTaskError as e:
                # The free port was taken by another process before rank 0 listened on it
                # (other services on the node pick free ports too): new ranks, a new port.
                if "EADDRINUSE" not in str(e) or attempt == RENDEZVOUS_ATTEMPTS:
                    raise
                logger.warning("rendezvous port %d was taken meanwhile; retrying (%d/%d)",
                               port, attempt, RENDEZVOUS_ATTEMPTS)
                for w in self.workers:
                    ray.kill(w)
        self.policy_version = 0
        logger.info("learner group of %d rank(s) up (rendezvous %s:%d)", n, addr, port)

    def update(self, batch: Sequence[Slice] | pa.Table) -> dict[str, float]:
        """One iteration on every rank; ``batch``: buffer slices (or a table, for tests)."""
        arg = batch if not isinstance(batch, pa.Table) else ray.put(batch)
        return combine_rank_metrics(ray.get([w.update.remote(arg) for w in self.workers]))

    def logprobs(self, table: pa.Table) -> list[list[float]]:
        return ray.get(self.workers[0].logprobs.remote(table))

    def sync_payload(self) -> tuple[str, dict[str, Any]]:
        """Rank 0's weights for serving (all ranks join the gather under ZeRO-3)."""
        return ray.get([w.sync_payload.remote() for w in self.workers])[0]

    def put_weights(self, version: int) -> dict[str, Any]:
        """Rank 0's weights as ``version``'s payload in the object store: ``{"kind",
        "payload": [ref], "bytes", "seconds"}`` (``WeightPublisher.publish`` publishes it)."""
        info = ray.get([w.put_weights.remote(version) for w in self.workers])[0]
        self.policy_version = version
        return info

    def save(self, path: str | Path, client_state: dict[str, Any]) -> None:
        ray.get([w.save.remote(str(path), {**client_state, "policy_version": self.policy_version})
                 for w in self.workers])

    def load(self, path: str | Path) -> dict[str, Any]:
        states = ray.get([w.load.remote(str(path)) for w in self.workers])
        self.policy_version = int(states[0]["policy_version"])
        return states[0]

    def send_nccl(self, version: int, app: str, ranks_per_replica: int = 1) -> dict[str, Any]:
        """Rank 0 broadcasts its weights into ``app``'s vLLM replicas as ``version`` over NCCL
        (``clawray/weights/nccl.py``); ``{"kind": "nccl", "bytes", "seconds"}``."""
        info = ray.get([w.send_nccl.remote(version, app, ranks_per_replica)
                        for w in self.workers])[0]
        self.policy_version = version
        return info

    def set_version(self, version: int) -> None:
        ray.get([w.set_version.remote(version) for w in self.workers])
        self.policy_version = version

    def update_user(self, user: str, table: pa.Table) -> dict[str, Any]:
        """One update of ``user``'s adapter (one rank: ``clawray/learner/adapters.py``)."""
        if len(self.workers) != 1:
            raise RuntimeError("per-user adapters train on one learner rank")
        return ray.get(self.workers[0].update_user.remote(user, ray.put(table)))

    def restart_lora(self, payload_box: list | None) -> int:
        """The policy gate: restart the adapter from a kept version (None: the base)."""
        return ray.get([w.restart_lora.remote(payload_box) for w in self.workers])[0]

    def stored_adapters(self) -> dict[str, int]:
        return ray.get(self.workers[0].stored_adapters.remote())

    def adapter_payload(self, user: str) -> list[Any]:
        return ray.get(self.workers[0].adapter_payload.remote(user))

    def shutdown(self) -> None:
        """Kill the ranks and free their resources (idempotent)."""
        workers, self.workers = self.workers, []
        for w in workers:
            ray.kill(w)
        if workers:
            remove_placement_group(self.pg)
