"""``clawray sft``: a supervised warm start on expert demonstrations, through the DeepSpeed learner.

RL on a model that never succeeds has nothing to reinforce (every GRPO group scores 0 and
carries no signal). So before environment RL, the policy imitates the family's expert solver:

1. ``sft.tasks`` tasks are generated (seeded, params up to ``sft.max_difficulty`` of the box)
   and played by the expert (``envs.demonstrate``); each step becomes an ``sft`` row whose
   prompt is the chat-templated history (exactly what a runner will send) and whose response
   is the expert action's text followed by ``<|im_end|>``. Recorded live turns with reward > 0
   can be added (``sft.live_samples``).
2. ``LearnerCore`` (the same DeepSpeed learner RL uses) trains ``sft.steps`` steps of
   ``sft.batch_size`` rows by negative log-likelihood (row kind ``sft``).
3. The result is saved as a model folder (weights + the base model's tokenizer and config),
   cached under ``sft.cache_dir`` by the hash of the base model and every setting that changes
   the result: a second run with the same config returns the folder at once.
4. Held-out tasks (``sft.eval_tasks``, a different seed) are played by the base and the
   warm-started model through clawray's own engine (seeded sampling at the runners'
   temperature, or ``sft.eval_temperature``); both success rates are reported.

Point ``model.path`` at the printed folder to serve and train from it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
from tqdm.auto import tqdm

from clawray.config import ClawRayConfig
from clawray.envs import TaskFamily, demo_tasks, demonstrate, make_family
from clawray.envs.base import Task
from clawray.envs.rollout import context_messages, render_prompt
from clawray.learner.group import free_port
from clawray.learner.learner import LearnerCore, init_distributed
from clawray.models.chat_template import IM_END
from clawray.models.loader import load_tokenizer, policy_model_info
from clawray.samples import SCHEMA, make_row, rows_to_batch
from clawray.training.evaluate import EVAL_MAX_DIFFICULTY, evaluate_model

logger = logging.getLogger(__name__)
RECIPE = "2"  # 2: tasks of the train pool (envs.task_pool). Bump when the rows or the training recipe change (not the eval protocol)
INFO = "clawray_sft.json"
EVAL_SEED_OFFSET = 1_000_003  # held-out tasks: a seed stream of their own (also rm_sft's)
SELECT_SEED = 2_000_003  # checkpoint selection's validation tasks: the same for every sft.seed


@dataclasses.dataclass
class SFTResult:
    path: Path
    cached: bool
    info: dict[str, Any]


def expert_rows(family: TaskFamily, tasks: list[Task], tokenizer: Any,
                history_window: int | None = None) -> list[dict[str, Any]]:
    """One ``sft`` row per expert step (prompt = history as a runner renders it)."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    rows = []
    for t, task in enumerate(tasks):
        demo = demonstrate(family, task)
        if not demo.success:
            raise RuntimeError(f"{family.name}: the expert failed {task.task_id}")
        env = family.make_env()
        env.reset(task)
        tools = getattr(env, "tools", None) or family.tools
        for i, (history, action) in enumerate(demo.steps):
            response = tokenizer.encode(action.text(), add_special_tokens=False) + [end]
            rows.append(make_row(
                sample_id=f"sft/{task.task_id}/{t}/{i}", kind="sft", source="env",
                trajectory_id=f"expert-{t}", task_id=task.task_id, step=i,
                prompt_ids=render_prompt(tokenizer, context_messages(history, history_window),
                                         tools),
                response_ids=response,
                rollout_logprobs=[0.0] * len(response), policy_version=0,
                loss_mask=[1] * len(response), reward=1.0, outcome=1))
    return rows


def live_rows(path: str) -> list[dict[str, Any]]:
    """Recorded live turns with a positive reward, as ``sft`` rows."""
    table = ds.dataset(Path(path).expanduser(), format="parquet", schema=SCHEMA).to_table()
    out = []
    for r in table.to_pylist():
        if r["reward"] > 0 and r["kind"] in ("rl", "combine") and sum(r["loss_mask"]):
            out.append(make_row(**{**r, "sample_id": f"sft/{r['sample_id']}", "kind": "sft",
                                   "advantage": None, "advantages": None}))
    return out


def files_digest(path: Path) -> str:
    """What a model folder's dependants are keyed by: its files' names, sizes and times, but
    not ``INFO`` (scores, which a rescoring rewrites without changing the model)."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name != INFO:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()


def pools(cfg: ClawRayConfig) -> tuple[str | None, str | None]:
    """The task pools a warm start trains on and checks itself on (``train``,
    ``validation``), or none where ``environments.task_pools`` is off."""
    e = cfg.environments_cfg
    return e.pool("train"), e.pool("validation")


def sft_key(base: Path, cfg: ClawRayConfig) -> str:
    """Hash of what determines the result: base model files, family, SFT and learner settings."""
    e = cfg.environments_cfg
    parts = {"recipe": RECIPE, "base": files_digest(base), "family": e.family,
             "family_kwargs": e.family_kwargs, "history_window": e.history_window,
             "task_pools": e.task_pools,
             "sft": cfg.sft_cfg.model_dump(exclude={"cache_dir", "eval_tasks",
                                                     "eval_temperature", "lora_rank",
                                                     "select_every", "select_tasks"}),
             "learner": learner_settings(cfg)}
    if cfg.sft_cfg.select_every:  # absent when off, so the builds without it keep their keys
        parts["select"] = {"every": cfg.sft_cfg.select_every, "tasks": cfg.sft_cfg.select_tasks,
                           "seed": SELECT_SEED, "temperature": e.temperature,
                           "max_difficulty": EVAL_MAX_DIFFICULTY}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def learner_settings(cfg: ClawRayConfig) -> dict[str, Any]:
    """The learner settings besides ``sft.*`` that change what ``train_sft`` produces."""
    t = cfg.training_cfg
    out = {"zero_stage": t.zero_stage, "max_pack_tokens": t.max_pack_tokens,
           "grad_clip": t.grad_clip, "betas": list(t.betas)}
    if cfg.sft_cfg.lora_rank:  # absent at 0, so the full-weight builds keep their keys
        out["lora"] = {"rank": cfg.sft_cfg.lora_rank, "alpha": t.lora_alpha,
                       "targets": t.lora_targets}
    return out


def cached_result(out: Path, force: bool = False) -> SFTResult | None:
    """The finished cache entry ``out`` (``cached=True``), or None if there is none or
    ``force`` asks for a new one."""
    if (out / INFO).is_file() and not force:
        return SFTResult(out, True, json.loads((out / INFO).read_text()))
    return None


def write_model(folder: Path, base: Path, model: Any) -> Path:
    """``model``'s weights and ``base``'s tokenizer and config files in ``folder``: a model
    folder that loads and serves like ``base``. A peft model (``sft.lora_rank``) is saved
    with its adapters merged into a copy of the weights."""
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, folder / f.name)
    model.save_pretrained(folder)
    return folder


def save_result(out: Path, base: Path, model: Any,
                describe: Callable[[Path], dict[str, Any]]) -> SFTResult:
    """Save the trained ``model`` as the cache entry ``out``, with ``base``'s tokenizer and
    config files. It is written to a temporary folder beside ``out``; ``describe(folder)``
    returns the info (it may load the saved model, e.g. to evaluate it), which goes to
    ``INFO``; then the folder is renamed into place, so an entry with ``INFO`` is complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        info = describe(write_model(tmp, base, model))
        (tmp / INFO).write_text(json.dumps(info, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return SFTResult(out, False, info)


def run_sft(cfg: ClawRayConfig, force: bool = False, progress: bool = True) -> SFTResult:
    """Warm-start the configured model on expert demonstrations (cached; see module doc)."""
    s = cfg.sft_cfg
    base = Path(policy_model_info(cfg).path)
    key = sft_key(base, cfg)
    out = Path(s.cache_dir).expanduser() / f"sft-{key}"
    family = make_family(cfg.environments_cfg.family, **cfg.environments_cfg.family_kwargs)
    if (hit := cached_result(out, force)) is not None:
        return rescored(hit, base, cfg, family)
    tokenizer = load_tokenizer(base)
    t0 = time.perf_counter()
    train_pool = pools(cfg)[0]
    rows = expert_rows(family, demo_tasks(family, s.tasks, s.max_difficulty, s.seed, train_pool),
                       tokenizer,
                       cfg.environments_cfg.history_window)
    if s.live_samples:
        rows += live_rows(s.live_samples)
    select = policy_selection(base, cfg, family) if s.select_every else None
    history = train_sft(base, cfg, rows, progress, select=select)

    def describe(saved: Path) -> dict[str, Any]:
        info = {"key": key, "base": str(base), "family": family.name, "rows": len(rows),
                "demo_tasks": s.tasks, "steps": s.steps, "nll_first": history["nll"][0],
                "nll_last": history["nll"][-1], "train_s": time.perf_counter() - t0,
                "config": s.model_dump()}
        if select is not None:
            info.update(selection=history["selection"], selected_step=history["selected_step"])
        return {**info, **held_out_scoring(base, saved, cfg, family)}

    return save_result(out, base, history["model"], describe)


def selection_tasks(cfg: ClawRayConfig, family: TaskFamily) -> list[Task]:
    """The tasks checkpoint selection plays: ``sft.select_tasks`` tasks of the validation pool
    within ``EVAL_MAX_DIFFICULTY`` of the box (as hard as the held-out evaluations), from a
    seed stream of their own that does not depend on ``sft.seed``, so warm starts of several
    seeds are rated on the same tasks."""
    return demo_tasks(family, cfg.sft_cfg.select_tasks, EVAL_MAX_DIFFICULTY, SELECT_SEED,
                      pools(cfg)[1])


def policy_selection(base: Path, cfg: ClawRayConfig, family: TaskFamily) -> Selection:
    """Rate the policy being trained by its success on ``selection_tasks`` at the runners'
    temperature (``evaluate_model`` on a copy saved to a temporary folder) every
    ``sft.select_every`` steps."""
    tasks = selection_tasks(cfg, family)

    def score(model: Any) -> float:
        with tempfile.TemporaryDirectory(prefix="clawray-sft-select-") as tmp:
            return evaluate_model(write_model(Path(tmp), base, model), cfg, tasks)

    return Selection(cfg.sft_cfg.select_every, score)


def eval_settings(cfg: ClawRayConfig) -> dict[str, Any]:
    """How the held-out scoring is asked for: its task count and sampling temperature."""
    s = cfg.sft_cfg
    return {"eval_tasks": s.eval_tasks,
            "eval_temperature": (cfg.environments_cfg.temperature if s.eval_temperature is None
                                 else s.eval_temperature)}


def held_out_scoring(base: Path, saved: Path, cfg: ClawRayConfig, family: Any) -> dict[str, Any]:
    """Success of ``base`` and ``saved`` on ``sft.eval_tasks`` held-out tasks (of the
    validation pool, a seed stream of their own) at ``eval_settings``' temperature; {} when
    no tasks are asked for."""
    s = cfg.sft_cfg
    held_out = demo_tasks(family, s.eval_tasks, s.max_difficulty, s.seed + EVAL_SEED_OFFSET,
                          pools(cfg)[1])
    if not held_out:
        return {}
    settings = eval_settings(cfg)
    return {**settings, "eval_tasks": len(held_out),
            "success_before": evaluate_model(base, cfg, held_out, settings["eval_temperature"]),
            "success_after": evaluate_model(saved, cfg, held_out, settings["eval_temperature"])}


def rescored(hit: SFTResult, base: Path, cfg: ClawRayConfig, family: Any) -> SFTResult:
    """A cached entry whose held-out scoring is the one ``cfg`` asks for: the eval settings
    are not part of the cache key (they do not change the model), so an entry scored with
    other ones is scored again and its info file updated."""
    wanted = eval_settings(cfg)
    if not wanted["eval_tasks"] or all(hit.info.get(k) == v for k, v in wanted.items()):
        return hit
    info = {**hit.info, **held_out_scoring(base, hit.path, cfg, family)}
    (hit.path / INFO).write_text(json.dumps(info, indent=2))
    return SFTResult(hit.path, True, info)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` torch threads, then restore the count: a different thread count
    sums in a different order, and a small model trained for hundreds of steps lands somewhere
    else, so a build meant to be the same on any machine pins it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Early stopping on held-out data: every ``every`` steps (and after the last) ``score``
    rates the model being trained (higher is better, scored in eval mode without gradients);
    ``train_sft`` returns the best-rated weights, the earliest on a tie."""

    every: int
    score: Callable[[Any], float]

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"Selection.every must be at least 1, got {self.every}")


def train_sft(base: Path, cfg: ClawRayConfig, rows: list[dict[str, Any]],
              progress: bool, threads: int | None = None,
              select: Selection | None = None) -> dict[str, Any]:
    """``sft.steps`` NLL steps on random batches of ``rows`` with one DeepSpeed rank; with
    ``threads``, on that many torch threads (``torch_threads``). The result: ``model``, the
    ``nll`` per step and, with ``select``, the ``selection`` curve (``[{step, score}]``), the
    ``selected_step`` whose weights ``model`` holds, and the ``last_model`` (the weights after
    the last step, a separate copy) when that is another step. Scoring consumes nothing of
    the batch sampler's stream: the steps up to the selected one are those of a run without
    ``select``."""
    if threads is not None:
        with torch_threads(threads):
            return train_sft(base, cfg, rows, progress, select=select)

    s = cfg.sft_cfg
    t = cfg.training_cfg.model_copy(update={
        "lr": s.lr, "mini_batches": 1, "micro_batches": 1, "num_learners": 1,
        "lora_rank": s.lora_rank,
        "seed": s.seed, "loss": cfg.training_cfg.loss.model_copy(update={"kl_coef": 0.0})})
    init_distributed(0, 1, "127.0.0.1", free_port("127.0.0.1"))
    learner = LearnerCore(base, t)
    table = pa.Table.from_batches([rows_to_batch(rows)])
    rng = np.random.default_rng(s.seed)
    nll: list[float] = []
    curve: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, Any]] | None = None
    with tqdm(total=s.steps, disable=not progress, desc="clawray sft", unit="step") as bar:
        for step in range(1, s.steps + 1):
            idx = rng.choice(table.num_rows, size=min(s.batch_size, table.num_rows),
                             replace=False)
            m = learner.update(table.take(pa.array(np.sort(idx))))
            nll.append(float(m["loss"]))
            if select is not None and (step % select.every == 0 or step == s.steps):
                score = _rate(learner.module, select)
                curve.append({"step": step, "score": score})
                if best is None or score > best[0]:
                    best = (score, step, _snapshot(learner.module))
                bar.set_postfix(nll=f"{nll[-1]:.3f}", val=f"{score:.3f}", refresh=False)
            else:
                bar.set_postfix(nll=f"{nll[-1]:.3f}", refresh=False)
            bar.update(1)
    out: dict[str, Any] = {"model": learner.module, "nll": nll}
    if best is not None:
        _, chosen, weights = best
        out.update(selection=curve, selected_step=chosen)
        if chosen != s.steps:
            out["last_model"] = copy.deepcopy(learner.module)
            learner.module.load_state_dict(weights)
    return out


def _rate(module: Any, select: Selection) -> float:
    import torch

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return float(select.score(module))
    finally:
        module.train(was_training)


def _snapshot(module: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
