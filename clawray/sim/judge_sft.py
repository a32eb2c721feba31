r"""``clawray judge-sft``: a judge MODEL for the live loop, trained on one wording of user
feedback and tested on another.

The live loop's PRM reads an assistant reply and the user's next message and answers
``\boxed{1}`` (the reply worked), ``\boxed{-1}`` (the user asks for a change) or ``\boxed{0}``
(neither). The heuristic rule judge (``clawray/judging/rules.py``) does that with keyword
lists; this builds a small model that does it from examples, so a demo's learning signal does
not depend on users saying the judge's keywords:

1. ``judge_examples``: seeded synthetic turns. A request from a prompt pool
   (``clawray/sim/users.py``), a reply (canned, short, long, unreadable or empty), and the
   user's next message: a reaction worded from a phrasing pool (``clawray/sim/feedback.py``;
   approval if the ``brief`` preference is met, else a complaint saying what was wrong), alone
   or followed by the next request, labelled +1 / -1; or only a next request, labelled 0. The
   labels are balanced by construction (``NEUTRAL_SHARE`` neutral, the rest half and half).
2. Each example becomes an ``sft`` row: prompt = the PRM judge prompt
   (``judging/prompts.build_prm_prompt``) chat-templated as the JudgeServer templates it,
   response = ``\boxed{label}<|im_end|>``.
3. ``sft.steps`` NLL steps (``steps`` here) through the same learner as ``clawray sft``, from
   ``model.path`` (the embedded model by default); cached by the base model's files and every
   setting (``<sft.cache_dir>/judge-sft-<key>``).
4. Evaluated with ``m`` sampled votes per example (the JudgeServer's way) on the validation
   wording (``judge_validation`` phrasing, ``validation`` prompts: for choosing settings) and
   the test wording (``users`` phrasing, ``test`` prompts: reported), before and after, next to
   the heuristic judge on the same examples: recall per label (p₊, p₋, p₀), balanced accuracy
   over the three labels, and over ±1 (what training uses).

The training examples use the ``judge_train`` phrasing and the ``train`` prompts only; the
three splits share no reaction (their frames and closers differ) and no prompt template
(tested). Openers and bodies are partly shared (``clawray/sim/feedback.py`` says why): the
evaluation reports "familiar" reactions (trained words in new frames) and "novel" ones (new
words) apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

from clawray.config import ClawRayConfig
from clawray.envs.rollout import render_prompt
from clawray.judging.parse import parse_vote
from clawray.judging.prompts import TurnContext, build_prm_prompt
from clawray.judging.rules import classify_next_state
from clawray.models.chat_template import IM_END
from clawray.models.corpus import REPLY_GREETING, REPLY_OTHER, REPLY_QUESTION, sentence
from clawray.models.loader import load_tokenizer, policy_model_info, resolve_model_path
from clawray.samples import make_row
from clawray.sim.feedback import familiar, react
from clawray.sim.preferences import BriefReplies, reason_of
from clawray.sim.users import SYSTEM_PROMPT, make_request
from clawray.training.evaluate import sampled_votes
from clawray.stats import seed_stats
from clawray.training.sft import (SFTResult, cached_result, files_digest, learner_settings,
                                  save_result, train_sft)

RECIPE = "2"  # bump when the examples, the rows or the training recipe change
# Torch threads of the build: the same recipe built on two threads and on one gave judges with
# p+ 0.36 and 0.94 on the users' wording (docs/training.md); pinned, a key is one model.
SFT_THREADS = 1
NEUTRAL_SHARE = 0.2
EVAL_TEMPERATURE = 0.6  # the JudgeServer's default (judge.temperature)
LABELS = (1, -1, 0)
# (phrasing pool, prompt pool) per split: disjoint in both.
SPLITS = {"train": ("judge_train", "train"), "validation": ("judge_validation", "validation"),
          "test": ("users", "test")}


@dataclasses.dataclass
class JudgeExample:
    ctx: TurnContext
    label: int  # 1 / -1 / 0
    familiar: bool = True  # the reaction's sentiment words all occur in the training wording


def draw_reply(rng: random.Random, satisfied: bool) -> str:
    """A reply the ``brief`` preference accepts (``satisfied``) or rejects, of varied kinds."""
    pref = BriefReplies()
    for _ in range(100):
        if satisfied:
            kind = rng.choice(("canned", "short", "short"))
            text = (rng.choice((REPLY_GREETING, REPLY_OTHER)) if kind == "canned"
                    else " ".join(sentence(rng).split()[:rng.randint(1, 7)]).rstrip(",;") + ".")
        else:
            kind = rng.choice(("canned", "long", "long", "unreadable", "empty"))
            if kind == "canned":
                text = REPLY_QUESTION
            elif kind == "long":
                text = " ".join(sentence(rng) for _ in range(rng.randint(1, 3)))
            elif kind == "unreadable":
                text = "".join(rng.choice('",.;:!?-*#') for _ in range(rng.randint(3, 40)))
            else:
                text = rng.choice(("", " ", "\n"))
        if pref.satisfied(text) == satisfied:
            return text
    raise RuntimeError("could not draw a reply of the wanted kind")  # pragma: no cover


def judge_examples(n: int, split: str, seed: int = 0) -> list[JudgeExample]:
    """``n`` seeded examples of ``split`` (train / validation / test; ``SPLITS``)."""
    phrasing, prompts = SPLITS[split]
    rng = random.Random(f"judge/{split}/{seed}")
    out = []
    for _ in range(n):
        _, request = make_request(rng, pool=prompts)
        neutral = rng.random() < NEUTRAL_SHARE
        satisfied = rng.random() < 0.5
        reply = draw_reply(rng, satisfied)
        _, following = make_request(rng, pool=prompts)
        known = True
        if neutral:
            nxt, label = following, 0
        else:
            said = react(phrasing, satisfied, reason_of(reply), rng)
            known = familiar(phrasing, said, satisfied)
            nxt = said if rng.random() < 0.3 else f"{said} {following}"
            label = 1 if satisfied else -1
        ctx = TurnContext(history=[{"role": "system", "content": SYSTEM_PROMPT}],
                          request=[{"role": "user", "content": request}], response_text=reply,
                          response_tool_calls=[],
                          next_state=[{"role": "user", "content": nxt}])
        out.append(JudgeExample(ctx, label, known))
    return out


def verdict_text(label: int) -> str:
    return f"\\boxed{{{label}}}"


def judge_sft_rows(examples: list[JudgeExample], tokenizer: Any) -> list[dict[str, Any]]:
    end = tokenizer.convert_tokens_to_ids(IM_END)
    rows = []
    for i, ex in enumerate(examples):
        response = tokenizer.encode(verdict_text(ex.label), add_special_tokens=False) + [end]
        rows.append(make_row(
            sample_id=f"judge-sft/{i}", kind="sft", source="live", trajectory_id=f"judge-{i}",
            step=0, prompt_ids=render_prompt(tokenizer, build_prm_prompt(ex.ctx), None),
            response_ids=response, rollout_logprobs=[0.0] * len(response), policy_version=0,
            loss_mask=[1] * len(response), reward=float(ex.label)))
    return rows


def label_metrics(labels: list[int], votes: list[list[int | None]]) -> dict[str, Any]:
    """Recall per label from the majority of each example's votes (unparseable votes count
    for no side; a tie or no vote is a miss): p₊, p₋, p₀, balanced accuracy over the three
    labels and over ±1 only, and the unparseable share."""
    def majority(vs: list[int | None]) -> int | None:
        counts = {v: vs.count(v) for v in LABELS if v in vs}
        if not counts:
            return None
        best = max(counts.values())
        winners = [v for v, c in counts.items() if c == best]
        return winners[0] if len(winners) == 1 else None

    decided = [majority(v) for v in votes]
    recall = {}
    for want in LABELS:
        idx = [i for i, y in enumerate(labels) if y == want]
        recall[want] = sum(decided[i] == want for i in idx) / len(idx) if idx else None
    total = sum(len(v) for v in votes)
    pm = [recall[1], recall[-1]]
    return {"n": len(labels), "p_plus": recall[1], "p_minus": recall[-1], "p_zero": recall[0],
            "balanced_acc": (sum(r for r in recall.values() if r is not None)
                             / sum(r is not None for r in recall.values())),
            "balanced_acc_pm": sum(pm) / 2 if None not in pm else None,
            "unparseable": (sum(x is None for v in votes for x in v) / total) if total else None}


def split_metrics(examples: list[JudgeExample], votes: list[list[int | None]]
                  ) -> dict[str, Any]:
    """``label_metrics`` over all examples, and over the familiar ones (each reaction's
    sentiment said with words of the training wording, in new frames) and the novel ones
    (new words), the neutral examples in both."""
    out = label_metrics([e.label for e in examples], votes)
    for name, keep in (("familiar", True), ("novel", False)):
        idx = [i for i, e in enumerate(examples) if e.label == 0 or e.familiar == keep]
        if any(examples[i].label for i in idx):
            out[name] = label_metrics([examples[i].label for i in idx], [votes[i] for i in idx])
    return out


def heuristic_accuracy(examples: list[JudgeExample]) -> dict[str, Any]:
    """The heuristic rule judge on the same examples (deterministic: one vote each)."""
    return split_metrics(examples, [[classify_next_state(e.ctx.next_state)[0]]
                                    for e in examples])


def judge_accuracy(model_path: str | Path, cfg: ClawRayConfig, examples: list[JudgeExample],
                   m: int = 3, temperature: float = 0.6, seed: int = 0,
                   max_tokens: int = 24) -> dict[str, Any]:
    """``m`` sampled votes per example from the model at ``model_path`` (one engine call with
    ``n=m``, seeded ``seed + i``), majority against the labels (``label_metrics``)."""
    votes = sampled_votes(model_path, cfg, [build_prm_prompt(e.ctx) for e in examples], m,
                          temperature, seed, max_tokens, parse_vote)
    return split_metrics(examples, votes)


def judge_sft_key(base: Path, cfg: ClawRayConfig, settings: dict[str, Any]) -> str:
    blob = json.dumps({"recipe": RECIPE, "base": files_digest(base), **settings,
                       "learner": learner_settings(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_judge_sft(cfg: ClawRayConfig, force: bool = False, progress: bool = True,
                  n_train: int = 2000, n_eval: int = 300, m: int = 3,
                  base: str | Path | None = None, eval_base: bool = True) -> SFTResult:
    """Train (or load from the cache) the judge model and evaluate it; see the module doc."""
    s = cfg.sft_cfg
    base = (Path(resolve_model_path(str(base))) if base is not None
            else Path(policy_model_info(cfg).path))
    # What changes the model (the evaluation's size does not: it is recorded in the info).
    settings = {"n_train": n_train, "steps": s.steps, "batch_size": s.batch_size, "lr": s.lr,
                "seed": s.seed}
    key = judge_sft_key(base, cfg, settings)
    out = Path(s.cache_dir).expanduser() / f"judge-sft-{key}"
    if (hit := cached_result(out, force)) is not None:
        return hit
    t0 = time.perf_counter()
    train = judge_examples(n_train, "train", s.seed)
    rows = judge_sft_rows(train, load_tokenizer(base))
    history = train_sft(base, cfg, rows, progress, threads=SFT_THREADS)
    held_out = {split: judge_examples(n_eval, split, s.seed) for split in ("validation", "test")}

    def describe(saved: Path) -> dict[str, Any]:
        nll = history["nll"]
        info: dict[str, Any] = {
            "key": key, "base": str(base), "recipe": RECIPE, **settings, "n_eval": n_eval,
            "m": m, "eval_temperature": EVAL_TEMPERATURE, "rows": len(rows),
            "nll_first": nll[0], "nll_last": nll[-1], "train_s": time.perf_counter() - t0,
            "splits": {k: {"phrasing": v[0], "prompts": v[1]} for k, v in SPLITS.items()}}
        # The transformers engine starts in seconds (vLLM takes a minute per start); the
        # votes are the same model's either way.
        ev = cfg.copy_with(inference={"engine": "hf"})
        for split, examples in held_out.items():
            info[split] = {
                "heuristic": heuristic_accuracy(examples),
                "judge": judge_accuracy(saved, ev, examples, m, EVAL_TEMPERATURE, s.seed)}
            if eval_base:  # the model it started from (writes no verdict box: 0 throughout)
                info[split]["base"] = judge_accuracy(base, ev, examples, m, EVAL_TEMPERATURE,
                                                     s.seed)
        return info

    return save_result(out, base, history["model"], describe)


FIGURES = ("balanced_acc_pm", "balanced_acc", "p_plus", "p_minus", "p_zero")


def aggregate_builds(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Builds of one recipe over training seeds (their ``info``): per seed its cache key, build
    time and the judge's held-out figures (``FIGURES`` on the validation and the test wording);
    over seeds each figure's mean and standard error (n - 1 in the variance)."""
    per_seed = [{"seed": i["seed"], "key": i["key"], "train_s": round(i["train_s"], 1),
                 **{split: {f: i[split]["judge"][f] for f in FIGURES}
                    for split in ("validation", "test")}} for i in infos]
    settings = {k: infos[0][k] for k in ("recipe", "n_train", "steps", "batch_size", "lr",
                                         "n_eval", "m", "eval_temperature")}
    return {"settings": settings, "seeds": per_seed, "builds": len(per_seed),
            **{split: {f: seed_stats(p[split][f] for p in per_seed) for f in FIGURES}
               for split in ("validation", "test")}}
