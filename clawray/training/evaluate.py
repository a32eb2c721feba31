"""Held-out evaluation, in one place: success on held-out tasks (a model in this process, or
through serving by a trainer's env runners) and a step reward model's accuracy against the
oracle.

``clawray sft`` and ``clawray rm-sft`` measure their warm starts before and after with
``evaluate_model`` and ``rm_step_accuracy``; ``clawray env-demo`` and ``clawray rla-table``
measure a training run with ``held_out_success`` on ``held_out_tasks`` and ``step_accuracy``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import numpy as np

from clawray.config import ClawRayConfig
from clawray.envs import demo_tasks, make_family
from clawray.envs.base import Task
from clawray.envs.rollout import Episode, play_episode, render_prompt
from clawray.inference.engine import SamplingParams
from clawray.inference.factory import make_engine
from clawray.judging.step_rm import parse_step_score
from clawray.models.loader import ModelInfo, load_tokenizer
from clawray.rlanything.steps import StepContext, step_rm_request

EVAL_SAMPLES = 2  # each held-out task is played this many times
EVAL_SEED = 1234  # the sampling seed of held-out episodes played through serving
EVAL_MAX_DIFFICULTY = 0.3  # held-out tasks lie within this share of the family's box


# ------------------------------------------------------------------ task success

def play_tasks(path: Path, cfg: ClawRayConfig, tasks: list[Task],
               temperature: float | None = None, seed: int = 0) -> list[Episode]:
    """One episode per task with the model at ``path`` (clawray's engine, in this process),
    sampling at the runners' temperature with seeds ``seed + i`` (reproducible per weights).
    Greedy decoding would loop: a repeated observation gives the same wrong action again."""
    family = make_family(cfg.environments_cfg.family, **cfg.environments_cfg.family_kwargs)
    tokenizer = load_tokenizer(path)
    e = cfg.environments_cfg
    temp = e.temperature if temperature is None else temperature

    async def main() -> list[Episode]:
        engine = make_engine(cfg.model_cfg, cfg.inference_cfg, ModelInfo.from_path(path))
        try:
            async def gen(ids: list[int], p: SamplingParams) -> Any:
                return (await engine.generate(ids, p))[0]
            return list(await asyncio.gather(*(play_episode(
                family, t, gen, tokenizer,
                SamplingParams(max_tokens=e.max_tokens, temperature=temp, top_p=e.top_p,
                               seed=seed + i),
                e.max_steps, history_window=e.history_window) for i, t in enumerate(tasks))))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def evaluate_model(path: Path, cfg: ClawRayConfig, tasks: list[Task],
                   temperature: float | None = None, seed: int = 0) -> float:
    """Success rate of the model at ``path`` on ``tasks`` (``play_tasks``)."""
    results = [ep.success for ep in play_tasks(path, cfg, tasks, temperature, seed)]
    return float(np.mean(results)) if results else float("nan")


def held_out_tasks(cfg: ClawRayConfig, n: int, seed: int, pool: str = "test") -> list[Any]:
    """``n`` tasks within ``EVAL_MAX_DIFFICULTY`` of the box, from a seed stream no training
    or warm-start task is drawn from (``seed + 7_777_777``) and, with
    ``environments.task_pools`` (the default), of ``pool``: ``test`` (reported) or
    ``validation`` (for choosing settings), whose contents no training draw can produce."""
    e = cfg.environments_cfg
    family = make_family(e.family, **e.family_kwargs)
    return demo_tasks(family, n, EVAL_MAX_DIFFICULTY, seed + 7_777_777,
                      e.pool(pool))


def held_out_success(trainer: Any, cfg: ClawRayConfig, tasks: list[Any]) -> dict[str, Any]:
    """``tasks`` played through serving by the trainer's runners, seeded (``EVAL_SEED``) at
    the training temperature: the success rate, its binomial standard error and ``n``."""
    res = trainer.envs.evaluate(tasks, cfg.environments_cfg.temperature, EVAL_SEED)
    rate = float(np.mean([r["success"] for r in res]))
    return {"success": rate, "stderr": float(np.sqrt(rate * (1 - rate) / max(len(res), 1))),
            "n": len(res)}



# ------------------------------------------------------- step reward model accuracy


def sampled_votes(model_path: str | Path, cfg: ClawRayConfig,
                  messages: list[list[dict[str, Any]]], m: int, temperature: float, seed: int,
                  max_tokens: int, parse: Callable[[str], int | None],
                  seeds: list[int] | None = None) -> list[list[int | None]]:
    """``m`` sampled answers per judge prompt (``messages[i]``, chat-templated as serving
    templates it) from the model at ``model_path``: one engine call with ``n=m`` per prompt,
    seeded ``seed + i`` (or ``seeds[i]``: several sets of prompts on one engine start), each
    answer decoded and ``parse``d (None: no verdict)."""
    if seeds is not None and len(seeds) != len(messages):
        raise ValueError(f"sampled_votes: {len(seeds)} seeds for {len(messages)} prompts")
    tokenizer = load_tokenizer(model_path)

    async def main() -> list[list[int | None]]:
        engine = make_engine(cfg.model_cfg, cfg.inference_cfg, ModelInfo.from_path(model_path))
        slots = asyncio.Semaphore(cfg.inference_cfg.max_running)

        async def vote(i: int, prompt: list[dict[str, Any]]) -> list[int | None]:
            ids = render_prompt(tokenizer, prompt, None)
            params = SamplingParams(n=m, temperature=temperature, max_tokens=max_tokens,
                                    seed=seed + i if seeds is None else seeds[i])
            async with slots:
                outs = await engine.generate(ids, params)
            return [parse(tokenizer.decode(o.token_ids, skip_special_tokens=True))
                    for o in outs]
        try:
            return list(await asyncio.gather(*(vote(i, p) for i, p in enumerate(messages))))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def rm_step_accuracy(model_path: str | Path, cfg: ClawRayConfig, contexts: list[StepContext],
                     m: int = 3, temperature: float = 0.8, seed: int = 0) -> dict[str, Any]:
    """Score each step ``m`` times with the RM at ``model_path`` (one engine call with ``n=m``
    per step, seeded ``seed + i``; ``rlanything.max_tokens`` tokens) against the oracle.

    ``step_acc``: share of parseable scorings equal to the oracle label (None if none parse);
    ``majority_acc``: share of steps whose majority of the ``m`` scorings is the oracle label
    (unparseable scorings count for neither side; a tie is wrong); ``unparseable``: share of
    all scorings without a verdict; ``plus_acc`` / ``minus_acc``: ``step_acc`` over progress /
    no-progress steps only (an RM that always says -1 scores well on ``step_acc`` alone)."""
    window = cfg.environments_cfg.history_window
    scores = sampled_votes(model_path, cfg, [step_rm_request(c, window).messages
                                             for c in contexts],
                           m, temperature, seed, cfg.rlanything_cfg.max_tokens, parse_step_score)
    return step_accuracy([c.progress for c in contexts], scores)


def balanced(plus_acc: float | None, minus_acc: float | None) -> dict[str, float | None]:
    """Balanced accuracy ``(p₊ + p₋) / 2`` and Theorem 1's ``μ = p₊ + p₋`` (None when a class
    has nothing to count): what RM accuracy is judged by, as plain accuracy rewards answering
    the majority class."""
    if plus_acc is None or minus_acc is None:
        return {"balanced_acc": None, "mu": None}
    return {"balanced_acc": (plus_acc + minus_acc) / 2, "mu": plus_acc + minus_acc}


def nothing_happens_rule(contexts: list[StepContext]) -> list[list[int | None]]:
    """The one-cue rule as scorings (one per step): -1 iff the observation says the action did
    nothing ("nothing happens.", the household's answer to an invalid action), else +1. What an
    RM's accuracy is set against: on valid actions it says +1 always (balanced 0.5)."""
    return [[-1 if "nothing happens" in c.observation else 1] for c in contexts]


def step_accuracy(progress: list[bool], scores: list[list[int | None]]) -> dict[str, Any]:
    """``rm_step_accuracy``'s numbers from oracle labels and parsed scores (None: unparseable);
    a share with nothing to count is None (JSON null in the info file). ``balanced_acc`` and
    ``mu`` are computed from ``plus_acc`` (p₊) and ``minus_acc`` (p₋)."""
    def acc(which: list[int]) -> float | None:
        hits = [s == (1 if progress[i] else -1) for i in which for s in scores[i]
                if s is not None]
        return sum(hits) / len(hits) if hits else None

    steps = list(range(len(progress)))
    majority = [sum(s for s in scores[i] if s is not None) * (1 if progress[i] else -1) > 0
                for i in steps]
    total = sum(len(s) for s in scores)
    plus, minus = acc([i for i in steps if progress[i]]), acc([i for i in steps if not progress[i]])
    return {"step_acc": acc(steps),
            **balanced(plus, minus),
            "majority_acc": sum(majority) / len(steps) if steps else None,
            "unparseable": (sum(s is None for row in scores for s in row) / total
                            if total else None),
            "plus_acc": plus, "minus_acc": minus,
            "n_steps": len(steps), "n_plus": sum(progress)}
