"""Per-user LoRA adapters on one learner: each user's policy is a LoRA adapter trained only
from that user's rows (no Ray here).

The learner (``LearnerCore`` with ``lora_rank > 0``) has one adapter *slot* under DeepSpeed:
its LoRA tensors and the optimizer's state for them. ``UserAdapters`` keeps every user's
adapter (weights, AdamW moments and step, version, rows trained) in an ``AdapterStore`` on disk,
one file per user, and trains a user by swapping that user's state into the slot, running one
``LearnerCore.update`` on that user's rows, and writing the slot back. So:

- the number of users is bounded by disk, not by memory: one adapter is in the learner at a
  time, and only its tensors (a few MB for a 7B model's rank-16 adapter) move per swap;
- an update touches one user's adapter and nothing else: every other user's file is not
  written (tests check it byte for byte), and the base weights are frozen;
- a new user starts from the same fresh adapter (peft's initialization, B = 0: exactly the base
  policy), seeded by ``training.seed``.

Requires ZeRO stage 0, where the optimizer is the AdamW the learner built (its per-parameter
state can be swapped); stages 1-3 keep flat partitions of it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from clawray.files import write_atomic
from clawray.learner.learner import LearnerCore
from clawray.models import lora
from clawray.samples import policy_user_of

STATE_FORMAT = "clawray.user-adapter/1"
STATE_FILE = "adapter.pt"
MAX_USER_CHARS = 256


def user_slug(user: str) -> str:
    """The folder name of a user's adapter: a fingerprint, so any user id is a safe path and
    the folder names do not list the user ids (``meta.json`` inside holds the id)."""
    return "u-" + hashlib.sha256(user.encode()).hexdigest()[:24]


def check_user(user: Any) -> str:
    if not isinstance(user, str) or not user or len(user) > MAX_USER_CHARS:
        raise ValueError(f"a user id must be a non-empty string of at most {MAX_USER_CHARS} "
                         f"characters, got {user!r:.80}")
    return user


class AdapterStore:
    """Users' adapter states on disk: ``root/<user_slug>/adapter.pt`` (weights, optimizer
    state, meta) written atomically (temp file, fsync, rename) and ``meta.json`` beside it."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, user: str) -> Path:
        return self.root / user_slug(check_user(user))

    def path(self, user: str) -> Path:
        return self.folder(user) / STATE_FILE

    def exists(self, user: str) -> bool:
        return self.path(user).exists()

    def load(self, user: str) -> dict[str, Any] | None:
        """The user's state, or None for a user without an adapter."""
        path = self.path(user)
        if not path.exists():
            return None
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != STATE_FORMAT or state.get("meta", {}).get("user") != user:
            raise ValueError(f"{path} is not {user!r}'s adapter state ({STATE_FORMAT})")
        return state

    def meta(self, user: str) -> dict[str, Any] | None:
        path = self.folder(user) / "meta.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, user: str, weights: dict[str, torch.Tensor],
             optimizer: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
        folder = self.folder(user)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {**meta, "user": user}
        state = {"format": STATE_FORMAT, "weights": weights, "optimizer": optimizer,
                 "meta": meta}
        write_atomic(folder / STATE_FILE, lambda f: torch.save(state, f))
        write_atomic(folder / "meta.json", lambda f: f.write(json.dumps(meta, sort_keys=True).encode()))

    def users(self) -> list[dict[str, Any]]:
        """Every stored user's meta (user, version, rows, updated_at), by user id."""
        out = []
        for folder in sorted(self.root.glob("u-*")):
            meta_path = folder / "meta.json"
            if (folder / STATE_FILE).exists() and meta_path.exists():
                meta = json.loads(meta_path.read_text())
                meta["bytes"] = (folder / STATE_FILE).stat().st_size
                out.append(meta)
        return sorted(out, key=lambda m: m["user"])

    def delete(self, user: str) -> bool:
        """Remove the user's adapter and its optimizer state; False when there was none."""
        folder = self.folder(user)
        if not folder.exists():
            return False
        shutil.rmtree(folder)
        return True


class UserAdapters:
    """Trains and hands out per-user adapters through one LoRA learner slot."""

    def __init__(self, core: LearnerCore, store: AdapterStore) -> None:
        if not core.lora:
            raise ValueError("per-user adapters need LoRA training (training.lora_rank > 0)")
        if core.cfg.zero_stage != 0 or core.world_size != 1:
            raise ValueError("per-user adapters need one learner rank at ZeRO stage 0 (the "
                             f"optimizer state is swapped per user); got stage "
                             f"{core.cfg.zero_stage}, {core.world_size} ranks")
        self.core, self.store = core, store
        self.params = {n: p for n, p in core.module.named_parameters() if p.requires_grad}
        self.optimizer = _torch_optimizer(core)
        known = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if any(id(p) not in known for p in self.params.values()):
            raise ValueError("the learner's optimizer does not hold every adapter tensor")
        # Every new user starts here: peft's initialization (B = 0, the base policy itself).
        self.fresh = {n: p.detach().clone() for n, p in self.params.items()}
        self.active: str | None = None

    # ------------------------------------------------------------------ the slot

    def _load_slot(self, state: dict[str, Any] | None) -> None:
        weights = state["weights"] if state else self.fresh
        moments = state["optimizer"] if state else {}
        if set(weights) != set(self.params):
            raise ValueError("the stored adapter does not match this learner's LoRA layout "
                             "(a different lora_rank / lora_targets / model?)")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(weights[name].to(p.device, p.dtype))
                p.grad = None
                self.optimizer.state.pop(p, None)
                if name in moments:
                    self.optimizer.state[p] = {k: v.to(p.device).clone()
                                               for k, v in moments[name].items()}

    def _slot_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        weights = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        moments = {}
        for n, p in self.params.items():
            st = self.optimizer.state.get(p)
            if st:
                moments[n] = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v)
                                  else torch.tensor(v)) for k, v in st.items()}
        return weights, moments

    def activate(self, user: str) -> None:
        """Put ``user``'s adapter (a fresh one for a new user) in the learner's slot."""
        check_user(user)
        if self.active == user:
            return
        self.active = None  # a failed load leaves no user active
        self._load_slot(self.store.load(user))
        self.active = user

    # ------------------------------------------------------------------ per user

    def update(self, user: str, data: pa.Table) -> dict[str, float]:
        """One training iteration of ``user``'s adapter on ``data`` (rows whose policy user is
        ``user``, ``clawray.samples.policy_user_of``, and no other's);
        the adapter is saved before this returns. Returns the update's metrics plus the
        user's new ``version``."""
        users = set(policy_user_of(data).to_pylist())
        if users != {user}:
            raise ValueError(f"update({user!r}) got rows of other users: "
                             f"{sorted(map(str, users - {user}))[:5]}")
        self.activate(user)
        cfg = self.core.cfg
        meta = self.store.meta(user) or {
            "version": 0, "rows_trained": 0, "created_at": time.time(),
            "lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
            "peft_config": lora.config_dict(self.core.module.peft_config["default"])}
        try:
            metrics = self.core.update(data)
        except BaseException:
            self.active = None  # the slot may hold a half-applied step: reload next time
            raise
        meta = {**meta, "version": int(meta["version"]) + 1,
                "rows_trained": int(meta["rows_trained"]) + data.num_rows,
                "updated_at": time.time()}
        weights, moments = self._slot_state()
        self.store.save(user, weights, moments, meta)
        return {**metrics, "version": float(meta["version"])}

    def version(self, user: str) -> int:
        meta = self.store.meta(user)
        return int(meta["version"]) if meta else 0

    def payload(self, user: str) -> dict[str, Any]:
        """The user's adapter as a PEFT payload for serving (``clawray/models/lora.py``)."""
        self.activate(user)
        return lora.from_peft_model(self.core.module)

    @torch.no_grad()
    def logprobs(self, user: str, data: pa.Table) -> list[list[float]]:
        """Per row, ``user``'s policy's log-prob of each response token."""
        self.activate(user)
        return self.core.logprobs(data)

    def delete(self, user: str) -> bool:
        """Forget the user's adapter (the slot too, if it was theirs)."""
        if self.active == user:
            self.active = None
            self._load_slot(None)
        return self.store.delete(user)


def export_peft(store: AdapterStore, user: str, dest: str | Path) -> Path:
    """Write ``user``'s adapter as a PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``): ``peft.PeftModel.from_pretrained(base, dest)`` and vLLM's
    LoRA loading take it. Weights only; the optimizer state stays in the store."""
    state = store.load(user)
    if state is None:
        raise KeyError(f"user {user!r} has no adapter in {store.root}")
    meta, tensors, targets = state["meta"], {}, set()
    for name, t in state["weights"].items():
        # base_model.model.<module>.lora_A.default.weight -> ...lora_A.weight (PEFT's file keys)
        module, _, rest = name.partition(".lora_")
        tensors[f"{module}.lora_{rest.split('.', 1)[0]}.weight"] = t
        targets.add(module.rsplit(".", 1)[-1])
    # stores written before the config was kept hold its rank and alpha
    config = meta.get("peft_config") or lora.lora_config(meta["lora_rank"], meta["lora_alpha"],
                                                         targets)
    return lora.save_folder({"format": lora.PEFT_FORMAT, "config": config, "state": tensors},
                            dest)


def _torch_optimizer(core: LearnerCore) -> torch.optim.Optimizer:
    """The AdamW under DeepSpeed's engine at stage 0 (DeepSpeed may hand back a wrapper)."""
    opt = core.engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"cannot reach the learner's torch optimizer under {type(opt)}")
    return opt


@torch.no_grad()
def restart_lora(core: LearnerCore, payload: dict[str, Any] | None) -> int:
    """Set the learner's LoRA adapter to ``payload`` (a PEFT payload, ``clawray/models/lora.py``;
    None: the base policy, B = 0) and forget the adapter's optimizer moments: the
    policy gate's trainer restarting from the incumbent after its candidate was abandoned.
    One rank at ZeRO stage 0 (the weights are the optimizer's own). Returns the modules set."""
    if not core.lora:
        raise ValueError("restart_lora needs LoRA training (training.lora_rank > 0)")
    if core.cfg.zero_stage != 0 or core.world_size != 1:
        raise ValueError("restart_lora needs one learner rank at ZeRO stage 0, got stage "
                         f"{core.cfg.zero_stage}, {core.world_size} ranks")
    optimizer = _torch_optimizer(core)
    modules = lora.modules(payload) if payload is not None else None
    pairs = []
    for name, module in core.module.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or "default" not in lora_a:
            continue
        a, b = lora_a["default"].weight, module.lora_B["default"].weight
        base = name.removeprefix("base_model.model.")
        if modules is not None:
            m = modules.get(base)
            if m is None or tuple(m[0].shape) != tuple(a.shape) \
                    or tuple(m[1].shape) != tuple(b.shape):
                raise ValueError(f"the payload does not fit this learner's adapter at {base} "
                                 "(another lora_rank, lora_targets or model?)")
        pairs.append((a, b, None if modules is None else modules[base]))
    if modules is not None and len(pairs) != len(modules):
        raise ValueError(f"the payload has {len(modules)} modules, the learner's adapter "
                         f"{len(pairs)}")
    for a, b, m in pairs:
        if m is None:
            b.zero_()
        else:
            a.copy_(m[0].to(a.device, a.dtype))  # m: (A, B, scaling)
            b.copy_(m[1].to(b.device, b.dtype))
        for p in (a, b):
            p.grad = None
            optimizer.state.pop(p, None)
    return len(pairs)
