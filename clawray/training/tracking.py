"""Experiment tracking: one ``log(step, metrics)`` fanned out to the trackers people use.

TensorBoard event files by default (``tensorboardX``, what Ray Tune writes too), Weights &
Biases and MLflow when ``tracking.wandb`` / ``tracking.mlflow`` are on, each through the
library's own client. W&B and MLflow are optional packages: turned on without them, the
``Tracker`` refuses to start and says what to install (docs/operations.md).

What is logged: every finite number of a metrics dict, nested dicts flattened into ``a/b``
tags; events (``EVENT_KEYS``: the policy gate's decisions) as text. The run's config is logged
once, with the value of every key that names a secret (``SECRET_WORDS``) replaced.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import numbers
import re
import time
from pathlib import Path
from typing import Any, Mapping

from clawray.config import TrackingConfig

logger = logging.getLogger(__name__)

EVENT_KEYS = ("gate", "gate_events")  # logged as text, not dropped as non-numbers
# a key names a secret when one of its words (split at _ - . and spaces) is one of these:
# "api_key", "hf_token", "client_secret" are redacted; "max_tokens" and "keyword" are not
SECRET_WORDS = frozenset({"key", "keys", "token", "secret", "secrets", "password", "passwd"})
REDACTED = "<redacted>"


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of leaves keyed ``a/b/c``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers among ``metrics`` (flattened); strings, None, NaN, inf, booleans and
    lists are left out."""
    return {k: float(v) for k, v in flatten(metrics).items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}


def events(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The events among ``metrics`` (``EVENT_KEYS``) as text: a string as it is, anything
    else as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
            for k, v in metrics.items() if k in EVENT_KEYS and v is not None}


def names_a_secret(key: Any) -> bool:
    return bool(SECRET_WORDS & set(re.split(r"[_\-. ]+", str(key).lower())))


def redacted(obj: Any) -> Any:
    """``obj`` with the value of every dict key that names a secret (``SECRET_WORDS``)
    replaced by ``REDACTED``, at any depth (dicts and lists)."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if names_a_secret(k) else redacted(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redacted(v) for v in obj]
    return obj


def _require(package: str) -> Any:
    """The optional tracker's package, or an error that says how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        if e.name != package:  # installed, but something it imports is missing or broken
            raise ImportError(f"tracking.{package} is on but {package!r} cannot be imported: "
                              f"{e}", name=package) from e
        raise ImportError(f"tracking.{package} is on but the {package!r} package is not "
                          f"installed: `pip install {package}` (or set tracking.{package}: "
                          "false)", name=package) from e


class _TensorBoard:
    def __init__(self, log_dir: Path, config: dict[str, Any] | None) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(log_dir))
        if config is not None:  # indented: a code block in TensorBoard's markdown
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            self.writer.add_text("config", "\n".join("    " + line for line in
                                                     text.splitlines()), 0)

    def log(self, step: int, values: dict[str, float], texts: dict[str, str]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)
        self.writer.flush()  # an iteration takes seconds at least: curves stay current

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, wandb: Any, cfg: TrackingConfig, run_name: str, root: Path,
                 config: dict[str, Any] | None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=cfg.wandb_project, name=run_name, mode=cfg.wandb_mode,
                              dir=str(root), config=config)

    def log(self, step: int, values: dict[str, float], texts: dict[str, str]) -> None:
        self.run.log({**values, **texts}, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before W&B's service process has written the run (seen with
        # wandb 0.31, offline); teardown waits for it, as at the end of a script
        self.wandb.teardown()


class _MLflow:
    def __init__(self, mlflow: Any, cfg: TrackingConfig, run_name: str, root: Path,
                 config: dict[str, Any] | None) -> None:
        from mlflow.entities import Param

        uri, artifacts = cfg.mlflow_tracking_uri, None
        if uri is None:  # MLflow's local default (its file store is in maintenance mode)
            root.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(root / 'mlflow.db').resolve()}"
            artifacts = (root / "mlartifacts").resolve().as_uri()  # not ./mlruns of the cwd
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(cfg.mlflow_experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            cfg.mlflow_experiment, artifact_location=artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        if config is not None:
            self.client.log_batch(self.run_id, params=[
                Param(_mlflow_name(k), str(v)[:500]) for k, v in flatten(config).items()])

    def log(self, step: int, values: dict[str, float], texts: dict[str, str]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(_mlflow_name(k), v, now, step) for k, v in values.items()])
        for key, text in texts.items():
            self.client.log_text(self.run_id, text, f"events/{key}/{step:08d}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_name(key: str) -> str:
    """MLflow accepts letters, digits, ``_ - . /``, spaces and colons in names."""
    return re.sub(r"[^\w\-./ :]", "_", key)


class Tracker:
    """Fans each ``log(step, metrics)`` out to every tracker ``cfg`` turns on.

    ``root`` is the folder the defaults live in (``tensorboard/<run_name>``, ``wandb/``,
    ``mlflow.db`` and ``mlartifacts/``); ``config``, when given, is logged once with its
    secrets redacted."""

    def __init__(self, cfg: TrackingConfig, run_name: str, root: Path,
                 config: Mapping[str, Any] | None = None) -> None:
        wandb = _require("wandb") if cfg.wandb else None  # every missing package before
        mlflow = _require("mlflow") if cfg.mlflow else None  # anything is written
        safe = redacted(config) if config is not None else None
        self.backends: list[Any] = []
        self._failing: set[int] = set()
        try:
            if cfg.tensorboard:
                log_dir = Path(cfg.log_dir).expanduser() if cfg.log_dir else root / "tensorboard"
                self.backends.append(_TensorBoard(log_dir / run_name, safe))
            if wandb is not None:
                self.backends.append(_WandB(wandb, cfg, run_name, root, safe))
            if mlflow is not None:
                self.backends.append(_MLflow(mlflow, cfg, run_name, root, safe))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log to every tracker. A tracker that fails (a tracking server down) is reported
        once per run of failures and never stops training: the curves are the operator's,
        the model is the users'."""
        values, texts = scalars(metrics), events(metrics)
        for backend in self.backends:
            try:
                backend.log(step, values, texts)
                self._failing.discard(id(backend))
            except Exception:  # noqa: BLE001 - observability must not stop the job
                if id(backend) not in self._failing:
                    self._failing.add(id(backend))
                    logger.exception("%s could not log step %d; training goes on (logged "
                                     "again once it recovers and fails anew)",
                                     type(backend).__name__.strip("_"), step)

    def close(self) -> None:
        """Flush and close every tracker (once; later calls do nothing)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close()
