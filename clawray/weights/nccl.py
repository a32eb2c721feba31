"""``VLLMNcclSync``: NCCL broadcast from the learner's GPU into every vLLM replica (GPU only).

Written against vLLM 0.32.0's weight-transfer API (``vllm/distributed/weight_transfer/``,
docs.vllm.ai/en/v0.32.0/training/weight_transfer/nccl): the four-phase protocol
``init_weight_transfer_engine`` → ``start_weight_update`` → ``update_weights`` →
``finish_weight_update`` on the engine (``AsyncLLM``), and on the trainer the stateful
``NCCLTrainerWeightTransferEngine`` built by ``WeightTransferTrainerFactory.trainer_init(
NCCLTrainerInitInfo(...), client=..., source=...)`` and driven by ``send_weights()``. That engine
talks to the inference side through a structural ``VLLMWeightSyncClient`` (the four methods);
clawray's client publishes each phase to the app's ``AppControl`` actor instead of calling one
engine, because Serve replicas are reached by broadcast, not by address. The trainer is NCCL
rank 0; replica ``i``'s workers take ranks ``1 + i·ranks_per_replica …``.

The replicas' vLLM engines must start with ``weight_transfer_config=WeightTransferConfig(
backend="nccl")`` (an ``AsyncEngineArgs`` field). vLLM is imported only inside the methods that
need it: this module imports on a CPU machine, and using the sync there raises
``VLLMUnavailableError`` (the engine's own, from ``inference/vllm/availability.py``). Not run in CI (no
GPU); see docs/weights.md.
"""

from __future__ import annotations

import importlib.util
import socket
import time
import uuid
from typing import Any, Iterator, Mapping

import ray
import torch

from clawray.inference.vllm import VLLM_VERSION, VLLMUnavailableError
from clawray.weights.sync import WeightSync, WeightSyncError, check_state, state_nbytes


def check_nccl_available() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailableError(
            f"the 'nccl' weight sync needs vLLM {VLLM_VERSION} (`pip install 'clawray[vllm]'`) "
            "and CUDA GPUs; on CPU use 'object_store' or 'lora'")
    if not torch.cuda.is_available():
        raise VLLMUnavailableError("the 'nccl' weight sync needs a CUDA GPU "
                                   "(torch.cuda.is_available() is False)")


def update_info(state: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` fields, as a dict, for ``state`` in order."""
    return {"names": list(state),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()]}


def rank_offsets(replicas: list[str], ranks_per_replica: int) -> dict[str, int]:
    """NCCL rank of each replica's first worker: the trainer is rank 0."""
    return {rid: 1 + i * ranks_per_replica for i, rid in enumerate(sorted(replicas))}


class _StateSource:
    """A vLLM ``WeightSource`` over the state dict of the current round (replaced each send)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        device = torch.device("cuda", torch.cuda.current_device())
        for name, tensor in self.state.items():
            yield name, tensor.detach().to(device, non_blocking=True).contiguous()


class _ControlClient:
    """``VLLMWeightSyncClient`` whose phases are published to the app's control actor.

    Each replica, on seeing the version, runs init (first round of a group), start, update and
    finish on its own engine, concurrently with the trainer's rendezvous and broadcast.
    """

    def __init__(self, sync: VLLMNcclSync) -> None:
        self.sync = sync
        self.version = 0
        self.update_info: dict[str, list] = {}
        self.init_info: dict[str, Any] | None = None
        self._published = -1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.init_info = dict(init_info)
        self._publish()

    def start_weight_update(self, *args: Any, **kwargs: Any) -> None:
        pass  # each replica starts its own update when it sees the version

    def update_weights(self, update_info: Any) -> None:
        self._publish()

    def finish_weight_update(self, *args: Any, **kwargs: Any) -> None:
        pass  # each replica finishes and reports; finalize() waits for the reports

    def _publish(self) -> None:
        if self._published == self.version:  # init and update of a group's first round
            return
        s = self.sync
        payload = {"group": s.group, "rank_offsets": s.offsets, "update_info": self.update_info,
                   "init_info": self.init_info if s.fresh_group else None}
        s._publish(self.version, payload, s.round_bytes, s.round_started)
        self._published = self.version


class VLLMNcclSync(WeightSync):
    """Learner → vLLM replicas over NCCL; the control actor carries only the small metadata.

    The group is formed over the weight replicas live at ``prepare``; when that set changes the
    next ``send`` forms a new group (new port) with every live replica. A replica that dies
    mid-broadcast stalls the broadcast until NCCL times out: form a new group after that.
    """

    kind = "nccl"

    def __init__(self, app_name: str = "clawray", *, replica_id: str | None = None,
                 ranks_per_replica: int = 1, master_address: str | None = None,
                 master_port: int | None = None, packed: bool = True) -> None:
        super().__init__(app_name, replica_id=replica_id)
        self.ranks_per_replica = ranks_per_replica
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.group: str | None = None  # learner: the current group; replica: the joined one
        self.offsets: dict[str, int] = {}
        self.fresh_group = False
        self.round_bytes = 0
        self.round_started = 0.0
        self._engine: Any = None  # vLLM's NCCLTrainerWeightTransferEngine
        self._client = _ControlClient(self)
        self._source = _StateSource()

    @classmethod
    def for_app(cls, cfg: Any, **kwargs: Any) -> VLLMNcclSync:
        """The sync into the app that ``cfg`` (a ``ClawRayConfig``) deploys: its replicas' vLLM
        engines were created with the NCCL weight-transfer engine, and each takes
        ``tensor_parallel_size`` ranks of the group."""
        inference = cfg.inference_cfg
        if inference.engine not in ("vllm", "auto"):
            raise ValueError(f"the 'nccl' weight sync needs vLLM replicas, not engine "
                             f"{inference.engine!r}")
        if inference.weight_transfer != "nccl":
            raise ValueError("the app's vLLM engines must be created for it: set "
                             "`inference: weight_transfer: nccl`")
        return cls(cfg.training_cfg.app, ranks_per_replica=inference.tensor_parallel_size,
                   **kwargs)

    # ---- learner side -----------------------------------------------------------------------

    def prepare(self, version: int) -> None:
        check_nccl_available()
        super().prepare(version)
        status = ray.get(self.control.status.remote())
        live = [rid for rid, r in status["replicas"].items() if r["live"] and r["weights"]]
        if not live:
            raise WeightSyncError(f"app '{self.app_name}' has no live weight replica")
        offsets = rank_offsets(live, self.ranks_per_replica)
        if offsets != self.offsets:  # membership changed: a new group on the next send
            self._engine, self.offsets, self.group = None, offsets, None

    def send(self, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        check_nccl_available()
        if not self.offsets:
            raise WeightSyncError("call prepare(version) before send")
        self.round_started = time.perf_counter()
        self._source.state = check_state(state)
        self.round_bytes = state_nbytes(self._source.state)
        self._client.version = version
        self._client.update_info = update_info(self._source.state)
        self.fresh_group = self._engine is None
        if self.fresh_group:
            self.group = uuid.uuid4().hex
            self._engine = self._trainer_init()  # publishes init + this round to the replicas
        self._engine.send_weights()  # broadcast, concurrently with the replicas' update_weights
        self._sent[version]["seconds"] = time.perf_counter() - self.round_started
        return self._sent[version]

    def _trainer_init(self) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        world = 1 + len(self.offsets) * self.ranks_per_replica
        info = NCCLTrainerInitInfo(
            master_address=self.master_address or ray.util.get_node_ip_address(),
            master_port=self.master_port or _free_port(), world_size=world, packed=self.packed)
        return WeightTransferTrainerFactory.trainer_init(info, client=self._client,
                                                         source=self._source)

    # ---- replica side -----------------------------------------------------------------------

    async def receive(self, engine: Any, payload: Any, version: int) -> None:
        check_nccl_available()
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        llm = getattr(engine, "_llm", None)  # VLLMEngine's AsyncLLM
        if llm is None or not hasattr(llm, "update_weights"):
            raise WeightSyncError(
                f"the 'nccl' sync needs a VLLMEngine, not {type(engine).__name__}")
        offset = payload.get("rank_offsets", {}).get(self.replica_id)
        if offset is None:
            raise WeightSyncError(f"replica {self.replica_id} is not in NCCL group "
                                  f"{payload.get('group')}; the learner forms a new one")
        fresh = payload.get("init_info") is not None and payload["group"] != self.group
        if not fresh and payload["group"] != self.group:
            raise WeightSyncError(f"replica {self.replica_id} never joined NCCL group "
                                  f"{payload['group']}")
        await engine.pause()  # in-flight requests freeze (nothing is dropped), caches cleared
        try:
            if fresh:
                init = dict(payload["init_info"], rank_offset=offset)
                await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))
                self.group = payload["group"]
            await llm.start_weight_update()
            update = WeightTransferUpdateRequest(update_info=payload["update_info"])
            await llm.update_weights(update)
            await llm.finish_weight_update()
            await engine.load_weights({}, version)  # no tensors: adopt the version only
        finally:
            await engine.resume()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
