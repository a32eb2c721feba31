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
import math
import pkgutil
import re
import time
from typing import Any, ClassVar, Mapping

import ray
import torch

from clawray.inference.multi_lora import LORA_FORMAT
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


def lora_payload(peft_model: torch.nn.Module, adapter: str = "default") -> dict[str, Any]:
    """The LoRA payload of a peft model's ``adapter``: ``{"format", "modules": {base module
    name: {"A", "B", "scaling", "fan_in_fan_out"}}}``, names as in the base model's state dict
    (``model.layers.0.self_attn.q_proj`` → its ``.weight`` is merged)."""
    modules: dict[str, dict[str, Any]] = {}
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or adapter not in lora_a:
            continue
        flags = (getattr(module, "use_dora", {}), getattr(module, "lora_bias", {}))
        if any(f.get(adapter) for f in flags):
            raise WeightSyncError(f"{name}: DoRA / LoRA bias adapters cannot be merged by LoraSync")
        if getattr(module, "lora_variant", {}).get(adapter) is not None:
            raise WeightSyncError(f"{name}: LoRA variants cannot be merged by LoraSync")
        modules[_base_name(name)] = {
            "A": lora_a[adapter].weight.detach().cpu().clone(),
            "B": module.lora_B[adapter].weight.detach().cpu().clone(),
            "scaling": float(module.scaling[adapter]),
            "fan_in_fan_out": bool(getattr(module, "fan_in_fan_out", False)),
        }
    if not modules:
        raise WeightSyncError(f"the model has no LoRA linear layers for adapter '{adapter}'")
    return {"format": LORA_FORMAT, "modules": modules}


def lora_payload_from_state_dict(state: Mapping[str, torch.Tensor], *, lora_alpha: float,
                                 use_rslora: bool = False, fan_in_fan_out: bool = False,
                                 alpha_pattern: Mapping[str, float] | None = None
                                 ) -> dict[str, Any]:
    """The LoRA payload of a ``get_peft_model_state_dict``-style dict plus the LoRA config.

    Keys look like ``base_model.model.<module>.lora_A.weight`` / ``...lora_B.weight``; the rank
    is read from the tensors, alpha from ``alpha_pattern`` (regex on the module name, as in
    peft) or ``lora_alpha``; scaling is alpha / r (alpha / sqrt(r) with rsLoRA).
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in check_state(state).items():
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise WeightSyncError(f"not a LoRA linear weight: {key!r} (lora_A/lora_B only)")
        pairs.setdefault(_base_name(m.group(1)), {})[m.group(2)] = value.detach().cpu()
    modules = {}
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise WeightSyncError(f"{name}: needs both lora_A and lora_B, got {sorted(ab)}")
        alpha = next((a for pat, a in (alpha_pattern or {}).items()
                      if re.fullmatch(rf"(.*\.)?{pat}", name)), lora_alpha)
        r = ab["A"].shape[0]
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        modules[name] = {"A": ab["A"], "B": ab["B"], "scaling": float(scaling),
                         "fan_in_fan_out": fan_in_fan_out}
    return {"format": LORA_FORMAT, "modules": modules}


def _base_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.")


def merge_lora(base: Mapping[str, torch.Tensor], payload: Any) -> dict[str, torch.Tensor]:
    """``{module.weight: W0 + scaling · B @ A}`` for every module of ``payload``.

    ``base`` maps weight names to the unmerged weights. Every module is checked (known name,
    matching shapes, finite scaling) before anything is computed, so a bad payload raises
    WeightSyncError and produces nothing.
    """
    if not isinstance(payload, Mapping) or payload.get("format") != LORA_FORMAT:
        raise WeightSyncError(f"not a LoRA payload (expected format {LORA_FORMAT!r}); build it "
                              "with lora_payload(peft_model) or lora_payload_from_state_dict")
    modules = payload.get("modules")
    if not isinstance(modules, Mapping) or not modules:
        raise WeightSyncError("the LoRA payload has no modules")
    problems = []
    for name, mod in modules.items():
        target = f"{name}.weight"
        a, b = (mod.get("A"), mod.get("B")) if isinstance(mod, Mapping) else (None, None)
        if target not in base:
            problems.append(f"{name}: the model has no weight {target!r}")
        elif not (torch.is_tensor(a) and torch.is_tensor(b) and a.dim() == 2 and b.dim() == 2):
            problems.append(f"{name}: A and B must be 2-D tensors")
        elif a.shape[0] != b.shape[1]:
            problems.append(f"{name}: rank mismatch, A is {tuple(a.shape)}, B is {tuple(b.shape)}")
        else:
            out_in = (b.shape[0], a.shape[1])
            expected = tuple(base[target].shape)
            if (out_in[::-1] if mod.get("fan_in_fan_out") else out_in) != expected:
                problems.append(f"{name}: B @ A is {out_in}, the weight is {expected}")
            elif not math.isfinite(float(mod.get("scaling", float("nan")))):
                problems.append(f"{name}: scaling must be a finite number")
    if problems:
        raise WeightSyncError("bad LoRA payload: " + "; ".join(problems[:5]))
    merged = {}
    for name, mod in modules.items():
        w0 = base[f"{name}.weight"]
        delta = mod["B"].float() @ mod["A"].float()
        if mod.get("fan_in_fan_out"):
            delta = delta.T
        merged[f"{name}.weight"] = (w0.float() + float(mod["scaling"]) * delta.to(w0.device)
                                    ).to(w0.dtype)
    return merged


class LoraSync(WeightSync):
    """LoRA adapters as the payload; each replica merges them into its cached base weights.

    ``send`` takes a payload from :func:`lora_payload` or a ``get_peft_model_state_dict``-style
    dict (then pass the LoRA config here: ``lora_alpha``, ``use_rslora``, ``alpha_pattern``,
    ``fan_in_fan_out``). Every payload holds the full adapters (not increments): a replica
    merges them into the base weights it served before its first LoRA payload (or since the
    last full sync of another kind). Needs an engine that exposes its torch ``model`` (HFEngine).
    """

    kind = "lora"

    def __init__(self, app_name: str = "clawray", *, replica_id: str | None = None,
                 **lora_config: Any) -> None:
        super().__init__(app_name, replica_id=replica_id)
        self.lora_config = lora_config
        self._base: dict[str, torch.Tensor] = {}  # replica side: unmerged weights by name

    def payload(self, state: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(state, Mapping) and state.get("format") == LORA_FORMAT:
            return dict(state)
        if "lora_alpha" not in self.lora_config:
            raise WeightSyncError("a peft state dict needs the LoRA config: "
                                  "LoraSync(app, lora_alpha=..., use_rslora=...)")
        return lora_payload_from_state_dict(state, **self.lora_config)

    def encode(self, state: Mapping[str, Any]) -> tuple[Any, int]:
        payload = self.payload(state)
        nbytes = sum(state_nbytes({"A": m["A"], "B": m["B"]}) for m in payload["modules"].values())
        return payload, nbytes

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
        modules = payload.get("modules") if isinstance(payload, Mapping) else None
        names = [f"{n}.weight" for n in modules] if isinstance(modules, Mapping) else []
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
