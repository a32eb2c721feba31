"""Weight sync from the learner into every serving replica: one interface, several transports.

In the spirit of verl's checkpoint engine, a sync runs ``prepare(version)`` → ``send(state,
version)`` → (each replica) ``receive(engine, payload, version)`` → ``finalize(version)``.
The learner side publishes through the app's ``AppControl`` actor (``clawray/weights/control.py``);
every replica's ``WeightReceiver`` applies the payload between two generation steps and reports,
and ``finalize`` returns once every live replica serves the new version. Serving never stops:
requests in flight finish on the new weights and record ``policy_version_end``.

Transports (``make_weight_sync(kind, app_name)``):

* ``object_store`` — ``ObjectStoreSync``: the state dict (all or some of the model's names) is
  ``ray.put`` once; each replica fetches it and calls ``engine.load_weights``. CPU / HF engine.
* ``lora`` — ``LoraSync``: only the LoRA adapters travel; each replica merges them into its
  cached base weights (W = W0 + scaling · B @ A) and loads the merged tensors.
* ``nccl`` — ``VLLMNcclSync`` (``clawray/weights/nccl.py``): vLLM's NCCL weight transfer, GPU.
"""

from __future__ import annotations

import abc
import asyncio
import pkgutil
import time
from typing import Any, ClassVar, Mapping

import ray
import torch

from clawray.models import lora
from clawray.weights.control import get_app_control


class WeightSyncError(ValueError):
    """A payload or state that cannot be applied; nothing was changed."""


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def copy_baseline(state: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Bytes and seconds of an in-memory copy of ``state``: the floor a sync is compared to."""
    started = time.perf_counter()
    copies = {k: v.detach().clone() for k, v in state.items()}
    seconds = time.perf_counter() - started
    return {"bytes": state_nbytes(copies), "seconds": seconds}


def check_state(state: Any) -> dict[str, torch.Tensor]:
    """``state`` as a plain name → tensor dict, or a WeightSyncError saying what is wrong."""
    if not isinstance(state, Mapping) or not state:
        raise WeightSyncError("a state dict must be a non-empty mapping of name -> tensor")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise WeightSyncError(f"state dict entries that are not name -> tensor: {bad[:5]}")
    return dict(state)


class WeightSync(abc.ABC):
    """prepare → send → receive (on every replica) → finalize.

    The learner side (``prepare``/``send``/``finalize``) blocks on Ray calls; ``receive`` is a
    coroutine run by the replica's ``WeightReceiver``, which keeps one instance per kind, so an
    implementation may cache per-replica state on ``self`` between versions.
    """

    kind: ClassVar[str]

    def __init__(self, app_name: str = "clawray", *, replica_id: str | None = None) -> None:
        self.app_name = app_name
        self.replica_id = replica_id
        self._control: Any = None
        self._sent: dict[int, dict[str, float]] = {}

    @property
    def control(self) -> Any:
        if self._control is None:
            try:
                self._control = get_app_control(self.app_name)
            except ValueError as e:
                raise WeightSyncError(f"app '{self.app_name}' has no control actor: is the "
                                      "Serve app running in this Ray cluster?") from e
        return self._control

    def prepare(self, version: int) -> None:
        """Check ``version`` is newer than the published one (the app must be running)."""
        published = ray.get(self.control.status.remote())["version"]
        if version <= published:
            raise WeightSyncError(f"version {version} is not newer than the published version "
                                  f"{published} of app '{self.app_name}'")

    @abc.abstractmethod
    def send(self, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Publish ``state`` as ``version``; return ``{"bytes": ..., "seconds": ...}``."""

    @abc.abstractmethod
    async def receive(self, engine: Any, payload: Any, version: int) -> None:
        """Apply a published payload to ``engine`` (replica side) and adopt ``version``."""

    def finalize(self, version: int, timeout_s: float = 120.0,
                 min_replicas: int = 1) -> dict[str, Any]:
        """Wait until every live replica serves ``version``; return the replicas and timings.

        Raises TimeoutError naming the lagging replicas (and their errors) otherwise.
        """
        started = time.perf_counter()
        replicas = ray.get(self.control.wait_replicas.remote(version, timeout_s, min_replicas))
        waited = time.perf_counter() - started
        sent = self._sent.pop(version, {"bytes": 0, "seconds": 0.0})
        return {"version": version, "replicas": replicas, "bytes": sent["bytes"],
                "send_s": sent["seconds"], "apply_s": waited,
                "seconds": sent["seconds"] + waited}

    def sync(self, state: Mapping[str, torch.Tensor], version: int, timeout_s: float = 120.0,
             min_replicas: int = 1) -> dict[str, Any]:
        """The whole round: prepare, send, finalize."""
        self.prepare(version)
        self.send(state, version)
        return self.finalize(version, timeout_s, min_replicas)

    def encode(self, state: Mapping[str, Any]) -> tuple[Any, int]:
        """The payload a replica's ``receive`` takes for ``state``, and its size in bytes.

        Runs where the weights are (a learner rank), so only the payload is ever copied;
        transports that do not travel through the object store do not implement it."""
        raise NotImplementedError(f"the {self.kind!r} sync does not publish through the "
                                  "object store")

    def publish_ref(self, version: int, payload_ref: list[Any], nbytes: int,
                    seconds: float = 0.0) -> dict[str, float]:
        """Publish an already ``ray.put`` payload (``[ref]``: a one-element list, so Ray hands
        the reference on untouched) as ``version``; ``finalize`` reports ``nbytes`` and
        ``seconds`` (the sender's encode + put time) with the wait."""
        started = time.perf_counter()
        ray.get(self.control.publish.remote(version, self.kind, list(payload_ref)))
        timing = {"bytes": nbytes, "seconds": seconds + time.perf_counter() - started}
        self._sent[version] = timing
        return timing

    def _publish(self, version: int, payload: Any, nbytes: int, started: float) -> dict[str, float]:
        ref = [ray.put(payload)]
        return self.publish_ref(version, ref, nbytes, time.perf_counter() - started)


class ObjectStoreSync(WeightSync):
    """The state dict through Ray's object store, once, to every replica (CPU / HF engine)."""

    kind = "object_store"

    def encode(self, state: Mapping[str, Any]) -> tuple[Any, int]:
        state = {k: v.detach().cpu() for k, v in check_state(state).items()}
        return state, state_nbytes(state)

    def send(self, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        started = time.perf_counter()
        payload, nbytes = self.encode(state)
        return self._publish(version, payload, nbytes, started)

    async def receive(self, engine: Any, payload: Any, version: int) -> None:
        await engine.load_weights(check_state(payload), version)


# ---------------------------------------------------------------------------- LoRA


def merge_lora(base: Mapping[str, torch.Tensor], payload: Any) -> dict[str, torch.Tensor]:
    """``{module.weight: W0 + scaling · B @ A}`` for every module of ``payload`` (a PEFT
    payload, ``clawray.models.lora``).

    ``base`` maps weight names to the unmerged weights. Every module is checked (known name,
    matching shapes) before anything is computed, so a bad payload raises WeightSyncError and
    produces nothing.
    """
    try:
        mods = lora.fitted_modules(payload, {n: w.shape for n, w in base.items()})
    except lora.LoraFormatError as e:
        raise WeightSyncError(str(e)) from None
    merged = {}
    for name, (a, b, scaling) in mods.items():
        w0 = base[f"{name}.weight"]
        delta = b.float() @ a.float()
        merged[f"{name}.weight"] = (w0.float() + scaling * delta.to(w0.device)).to(w0.dtype)
    return merged


class LoraSync(WeightSync):
    """LoRA adapters as the payload; each replica merges them into its cached base weights.

    ``send`` takes a PEFT payload (``clawray.models.lora.from_peft_model``) or a
    ``get_peft_model_state_dict`` dict (then pass its LoRA config here: ``LoraSync(app,
    lora_alpha=..., use_rslora=..., ...)``, peft's LoraConfig fields). Every payload holds the
    full adapters (not increments): a replica merges them into the base weights it served
    before its first LoRA payload (or since the last full sync of another kind). An engine
    that serves adapters itself (vLLM) loads the payload as a LoRA request instead.
    """

    kind = "lora"

    def __init__(self, app_name: str = "clawray", *, replica_id: str | None = None,
                 **lora_config: Any) -> None:
        super().__init__(app_name, replica_id=replica_id)
        self.lora_config = lora_config
        self._base: dict[str, torch.Tensor] = {}  # replica side: unmerged weights by name

    def payload(self, state: Mapping[str, Any]) -> dict[str, Any]:
        try:
            if isinstance(state, Mapping) and state.get("format") == lora.PEFT_FORMAT:
                lora.modules(state)
                return dict(state)
            if "lora_alpha" not in self.lora_config:
                raise WeightSyncError("a peft state dict needs its LoRA config: "
                                      "LoraSync(app, lora_alpha=..., use_rslora=...)")
            return lora.from_state_dict(check_state(state), self.lora_config)
        except lora.LoraFormatError as e:
            raise WeightSyncError(str(e)) from None

    def encode(self, state: Mapping[str, Any]) -> tuple[Any, int]:
        payload = self.payload(state)
        return payload, lora.nbytes(payload)

    def send(self, state: Mapping[str, Any], version: int) -> dict[str, float]:
        started = time.perf_counter()
        payload, nbytes = self.encode(state)
        return self._publish(version, payload, nbytes, started)

    async def receive(self, engine: Any, payload: Any, version: int) -> None:
        if callable(getattr(engine, "load_lora", None)):  # the engine serves adapters itself
            await engine.load_lora(payload, version)
            return
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise WeightSyncError(f"LoRA merging needs an engine exposing its torch model "
                                  f"(HFEngine); {type(engine).__name__} does not")
        own = model.state_dict()
        try:
            names = [f"{n}.weight" for n in lora.modules(payload)]
        except lora.LoraFormatError as e:
            raise WeightSyncError(str(e)) from None
        base = {n: self._base.get(n, own.get(n)) for n in names if n in own}
        # Validates everything first; a big merge runs off the event loop that streams tokens.
        merged = await asyncio.to_thread(merge_lora, base, payload)
        for name in merged:  # cache the unmerged weights before they are first overwritten
            self._base.setdefault(name, own[name].detach().clone())
        await engine.load_weights(merged, version)


# ---------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[WeightSync] | str] = {
    ObjectStoreSync.kind: ObjectStoreSync,
    LoraSync.kind: LoraSync,
    "nccl": "clawray.weights.nccl:VLLMNcclSync",  # imported on use (its module pulls vLLM lazily)
}


def register_weight_sync(kind: str, cls: type[WeightSync] | str) -> None:
    _REGISTRY[kind] = cls


def make_weight_sync(kind: str, app_name: str = "clawray", **kwargs: Any) -> WeightSync:
    """The ``WeightSync`` registered as ``kind`` (object_store, lora, nccl) for ``app_name``."""
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ValueError(f"unknown weight sync {kind!r}: use one of {sorted(_REGISTRY)}")
    if isinstance(cls, str):
        cls = pkgutil.resolve_name(cls)
    return cls(app_name, **kwargs)
