r"""``clawray judge-sft``: a judge MODEL for the live loop, trained on one wording of user
feedback and tested on another.

The live loop's PRM reads an assistant reply and the user's next message and answers
``\boxed{1}`` (the reply worked), ``\boxed{-1}`` (the user asks for a change) or ``\boxed{0}``
(neither). The heuristic rule judge (``clawray/judging/rules.py``) does that with keyword
lists; this builds a small model that does it from examples, so a demo's learning signal does
not depend on users saying the judge's keywords:

1. ``judge_examples``: seeded synthetic turns. A request from a prompt pool
   (``clawray/sim/users.py``), a readable reply (canned or from the embedded model's corpus)
   that pleases either users who want brief replies or users who want detailed ones, never
   both, and the next message of a user with one of those two hidden preferences (half
   each): a reaction worded from a phrasing pool (``clawray/sim/feedback.py``; approval if
   the reply met the preference, else a complaint saying what was wrong), alone or followed
   by the next request, labelled +1 / -1; or only a next request, labelled 0. The label is
   what the user said: the same reply is +1 for one user and -1 for the other, so no rule
   that reads only the reply beats chance (``reply_rule_accuracy``, reported next to the
   judge; tested). The labels are balanced by construction (``NEUTRAL_SHARE`` neutral, the
   rest half and half).
2. Each example becomes an ``sft`` row: prompt = the PRM judge prompt
   (``judging/prompts.build_prm_prompt``) chat-templated as the JudgeServer templates it,
   response = ``\boxed{label}<|im_end|>``.
3. ``sft.steps`` NLL steps (``steps`` here) through the same learner as ``clawray sft``, from
   ``model.path`` (the embedded model by default); cached by the base model's files and every
   setting (``<sft.cache_dir>/judge-sft-<key>``).
4. Evaluated with ``m`` sampled votes per example (the JudgeServer's way) on the validation
   wording (``judge_validation`` phrasing, ``validation`` prompts: for choosing settings) and
   the test wording (``users`` phrasing, ``test`` prompts: reported), before and after, next to
   the heuristic judge and the reply-only rules on the same examples: recall per label (p₊, p₋, p₀), balanced accuracy
   over the three labels, and over ±1 (what training uses).

The training examples use the ``judge_train`` phrasing and the ``train`` prompts only; the
three splits share no prompt template and no opener, body, frame or closer of a reaction, and
the test wording shares no word with the training wording but function words (tested). For
the embedded model that is more than it can do: its judge knows no English beyond its
training rows, so on the test wording it can only pick up what the new words share with the
old by their spelling; a pretrained judge (``model.path``/``base``) brings its own English.
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
from clawray.sim.preferences import BriefReplies, DetailedReplies
from clawray.sim.users import SYSTEM_PROMPT, make_request
from clawray.training.evaluate import sampled_votes
from clawray.stats import seed_stats
from clawray.training.sft import (SFTResult, cached_result, files_digest, learner_settings,
                                  save_result, train_sft)

RECIPE = "3"  # bump when the examples, the rows or the training recipe change (3: two
# opposite user preferences, wording disjoint to the word)
# Torch threads of the build: the same recipe built on two threads and on one gave judges with
# p+ 0.36 and 0.94 on the users' wording (docs/training.md); pinned, a key is one model.
SFT_THREADS = 1
NEUTRAL_SHARE = 0.2
EVAL_TEMPERATURE = 0.6  # the JudgeServer's default (judge.temperature)
LABELS = (1, -1, 0)
# (phrasing pool, prompt pool) per split. validation and test are disjoint from train in both;
# seen_wording is new turns (held-out prompts, new replies and users) in the training wording:
# whether the judge learned to read what it was taught, apart from whether it generalizes.
SPLITS = {"train": ("judge_train", "train"), "seen_wording": ("judge_train", "validation"),
          "validation": ("judge_validation", "validation"), "test": ("users", "test")}
EVAL_SPLITS = ("seen_wording", "validation", "test")


@dataclasses.dataclass
class JudgeExample:
    ctx: TurnContext
    label: int  # 1 / -1 / 0: what the user's next message says
    preference: str = ""  # the user's hidden preference (USER_PREFERENCES), "" for none


# The users of the judge's examples: half want brief replies, half detailed ones (opposite
# preferences), and every reply pleases exactly one of them. The label is what the user's
# reaction says, so the same reply is +1 for one user and -1 for the other, and nothing in
# the reply tells them apart (tested: every rule that reads only the reply scores chance).
USER_PREFERENCES = {"brief": BriefReplies, "detailed": DetailedReplies}


def draw_reply(rng: random.Random, brief: bool) -> str:
    """A readable reply that ``brief`` users accept and ``detailed`` ones reject (``brief``),
    or the reverse: canned replies of the embedded model and sentences of its corpus."""
    for _ in range(100):
        if brief:
            text = (rng.choice((REPLY_GREETING, REPLY_OTHER)) if rng.random() < 1 / 3 else
                    " ".join(sentence(rng).split()[:rng.randint(1, 7)]).rstrip(",;") + ".")
        else:
            text = (REPLY_QUESTION if rng.random() < 1 / 3 else
                    " ".join(sentence(rng) for _ in range(rng.randint(1, 3))))
        if (BriefReplies().satisfied(text), DetailedReplies().satisfied(text)) == (brief,
                                                                                not brief):
            return text
    raise RuntimeError("could not draw a reply of the wanted kind")  # pragma: no cover


def judge_examples(n: int, split: str, seed: int = 0) -> list[JudgeExample]:
    """``n`` seeded examples of ``split`` (``SPLITS``): a request, a
    reply, and the next message of a user with a hidden preference: a reaction alone, a
    reaction and the next request (+1 approval, -1 complaint), or only the next request (0)."""
    phrasing, prompts = SPLITS[split]
    rng = random.Random(f"judge/{split}/{seed}")
    out = []
    for _ in range(n):
        _, request = make_request(rng, pool=prompts)
        neutral = rng.random() < NEUTRAL_SHARE
        who = rng.choice(sorted(USER_PREFERENCES))
        pref = USER_PREFERENCES[who](phrasing=phrasing)
        reply = draw_reply(rng, brief=rng.random() < 0.5)
        _, following = make_request(rng, pool=prompts)
        if neutral:
            nxt, label = following, 0
        else:
            satisfied = pref.satisfied(reply)
            said = pref.feedback(reply, satisfied, rng)
            nxt = said if rng.random() < 0.3 else f"{said} {following}"
            label = 1 if satisfied else -1
        ctx = TurnContext(history=[{"role": "system", "content": SYSTEM_PROMPT}],
                          request=[{"role": "user", "content": request}], response_text=reply,
                          response_tool_calls=[],
                          next_state=[{"role": "user", "content": nxt}])
        out.append(JudgeExample(ctx, label, "" if neutral else who))
    return out


def reply_rule_accuracy(examples: list[JudgeExample]) -> dict[str, Any]:
    """The trivial rules a cue in the reply alone would give, on the same examples: "+1 iff the
    reply is brief" and "+1 iff it is detailed" (one vote each, 0 never)."""
    out = {}
    for name, pref in (("brief_is_good", BriefReplies()), ("detailed_is_good",
                                                           DetailedReplies())):
        out[name] = label_metrics([e.label for e in examples],
                                  [[1 if pref.satisfied(e.ctx.response_text) else -1]
                                   for e in examples])
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
    """``label_metrics`` over all examples, and per user preference (``by_preference``: the
    examples of users with that preference, the neutral ones in each)."""
    out = label_metrics([e.label for e in examples], votes)
    out["by_preference"] = {}
    for who in USER_PREFERENCES:
        idx = [i for i, e in enumerate(examples) if e.preference in (who, "")]
        if any(examples[i].label for i in idx):
            out["by_preference"][who] = label_metrics([examples[i].label for i in idx],
                                                      [votes[i] for i in idx])
    return out


def heuristic_accuracy(examples: list[JudgeExample]) -> dict[str, Any]:
    """The heuristic rule judge on the same examples (deterministic: one vote each)."""
    return split_metrics(examples, [[classify_next_state(e.ctx.next_state)[0]]
                                    for e in examples])


def judge_accuracies(model_path: str | Path, cfg: ClawRayConfig,
                     splits: dict[str, list[JudgeExample]], m: int = 3,
                     temperature: float = 0.6, seed: int = 0,
                     max_tokens: int = 24) -> dict[str, dict[str, Any]]:
    """Per split, ``m`` sampled votes per example from the model at ``model_path`` (one
    engine call with ``n=m``, seeded ``seed + i`` within the split), majority against the
    labels (``split_metrics``); every split on one engine start (a real model's vLLM takes a
    minute to start)."""
    prompts, seeds = [], []
    for examples in splits.values():
        prompts += [build_prm_prompt(e.ctx) for e in examples]
        seeds += [seed + i for i in range(len(examples))]
    votes = sampled_votes(model_path, cfg, prompts, m, temperature, seed, max_tokens,
                          parse_vote, seeds=seeds)
    out, at = {}, 0
    for name, examples in splits.items():
        out[name] = split_metrics(examples, votes[at:at + len(examples)])
        at += len(examples)
    return out


def judge_sft_key(base: Path, cfg: ClawRayConfig, settings: dict[str, Any]) -> str:
    blob = json.dumps({"recipe": RECIPE, "base": files_digest(base), **settings,
                       "learner": learner_settings(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_judge_sft(cfg: ClawRayConfig, force: bool = False, progress: bool = True,
                  n_train: int = 2000, n_eval: int = 300, m: int = 3,
                  base: str | Path | None = None, eval_base: bool = True,
                  threads: int = SFT_THREADS, eval_engine: str = "hf") -> SFTResult:
    """Train (or load from the cache) the judge model and evaluate it; see the module doc."""
    s = cfg.sft_cfg
    base = (Path(resolve_model_path(str(base))) if base is not None
            else Path(policy_model_info(cfg).path))
    # What changes the model (the evaluation's size does not: it is recorded in the info).
    settings = {"n_train": n_train, "steps": s.steps, "batch_size": s.batch_size, "lr": s.lr,
                "seed": s.seed}
    if threads != SFT_THREADS:  # absent at the default, so earlier builds keep their keys
        settings["threads"] = threads
    key = judge_sft_key(base, cfg, settings)
    out = Path(s.cache_dir).expanduser() / f"judge-sft-{key}"
    if (hit := cached_result(out, force)) is not None:
        return hit
    t0 = time.perf_counter()
    train = judge_examples(n_train, "train", s.seed)
    rows = judge_sft_rows(train, load_tokenizer(base))
    history = train_sft(base, cfg, rows, progress, threads=threads)
    held_out = {split: judge_examples(n_eval, split, s.seed) for split in EVAL_SPLITS}

    def describe(saved: Path) -> dict[str, Any]:
        nll = history["nll"]
        info: dict[str, Any] = {
            "key": key, "base": str(base), "recipe": RECIPE, **settings, "n_eval": n_eval,
            "m": m, "eval_temperature": EVAL_TEMPERATURE, "rows": len(rows),
            "threads": threads, "lora_rank": s.lora_rank, "eval_engine": eval_engine,
            "nll_first": nll[0], "nll_last": nll[-1], "train_s": time.perf_counter() - t0,
            "splits": {k: {"phrasing": v[0], "prompts": v[1]} for k, v in SPLITS.items()}}
        # The transformers engine starts in seconds (vLLM takes a minute per start, and pays
        # off on a real model's hundreds of 600-token prompts); the votes are the same model's
        # either way.
        ev = cfg.copy_with(inference={"engine": eval_engine})
        judged = judge_accuracies(saved, ev, held_out, m, EVAL_TEMPERATURE, s.seed)
        # the model it started from (the embedded one writes no verdict box: 0 throughout)
        before = (judge_accuracies(base, ev, held_out, m, EVAL_TEMPERATURE, s.seed)
                  if eval_base else {})
        for split, examples in held_out.items():
            info[split] = {"heuristic": heuristic_accuracy(examples),
                           "reply_rules": reply_rule_accuracy(examples),
                           "judge": judged[split]}
            if split in before:
                info[split]["base"] = before[split]
        return info

    return save_result(out, base, history["model"], describe)


FIGURES = ("balanced_acc_pm", "balanced_acc", "p_plus", "p_minus", "p_zero")
LEDGER_POOLS = {"validation": "validation", "test": "test"}  # split -> the ledger's pool


def ledger_lines(info: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """A fresh build's held-out figures for the ledger (experiment ``judge-sft``, with the base
    model's name for anything but the embedded model): per split of ``LEDGER_POOLS``, the
    judge's ``FIGURES`` (arm ``judge``), the heuristic rule judge's and the reply-only rules'
    ±1 balanced accuracy beside them (arms ``heuristic``, ``rule/<name>``), and the base
    model's when it was evaluated (arm ``base``). The build's settings ride along."""
    settings = {k: info[k] for k in ("recipe", "n_train", "steps", "batch_size", "lr", "m",
                                     "eval_temperature", "key") if k in info}
    settings.update({k: info[k] for k in ("lora_rank", "threads") if info.get(k)})
    lines = []
    for split, pool in LEDGER_POOLS.items():
        row = info.get(split)
        if row is None:
            continue
        n = row["judge"]["n"]
        common = {"experiment": "judge-sft" + ("" if model == "embedded" else f"-{model}"),
                  "seed": info["seed"], "pool": pool, "n": n, **settings}
        for arm in ("judge", "base"):
            if arm in row:
                lines += [{**common, "arm": arm, "metric": f, "value": row[arm][f]}
                          for f in FIGURES if row[arm][f] is not None]
        if (h := row["heuristic"]["balanced_acc_pm"]) is not None:
            lines.append({**common, "arm": "heuristic", "metric": "balanced_acc_pm", "value": h})
        lines += [{**common, "arm": f"rule/{name}", "metric": "balanced_acc_pm",
                   "value": m["balanced_acc_pm"]}
                  for name, m in row.get("reply_rules", {}).items()
                  if m["balanced_acc_pm"] is not None]
    return lines


def aggregate_builds(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Builds of one recipe over training seeds (their ``info``): per seed its cache key, build
    time and the judge's held-out figures (``FIGURES`` on the validation and the test wording);
    over seeds each figure's mean and standard error (n - 1 in the variance)."""
    per_seed = [{"seed": i["seed"], "key": i["key"], "train_s": round(i["train_s"], 1),
                 **{split: {f: i[split]["judge"][f] for f in FIGURES}
                    for split in EVAL_SPLITS if split in i}} for i in infos]
    settings = {k: infos[0][k] for k in ("recipe", "n_train", "steps", "batch_size", "lr",
                                         "n_eval", "m", "eval_temperature")}
    settings.update({k: infos[0][k] for k in ("lora_rank", "threads") if infos[0].get(k)})
    splits = [split for split in EVAL_SPLITS if all(split in p for p in per_seed)]
    return {"settings": settings, "seeds": per_seed, "builds": len(per_seed),
            **{split: {f: seed_stats(p[split][f] for p in per_seed) for f in FIGURES}
               for split in splits},
            "beside": {split: beside(infos, split) for split in splits}}


def beside(infos: list[dict[str, Any]], split: str) -> dict[str, Any]:
    """What the judge is compared with on ``split``'s examples, over the builds: ±1 balanced
    accuracy of the keyword rule judge, of each rule that reads only the reply, and of the
    model the judge started from (where measured), each ``seed_stats``; and the judge minus
    the better reply-only rule of each build, paired by seed (``paired_difference``)."""
    from clawray.stats import paired_difference

    def pm(info: dict[str, Any], *path: str) -> float | None:
        node: Any = info[split]
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node.get("balanced_acc_pm") if isinstance(node, dict) else None

    rule_names = sorted(infos[0][split].get("reply_rules", {}))
    names = {"heuristic": ("heuristic",), "base": ("base",)} | {
        f"rule/{r}": ("reply_rules", r) for r in rule_names}
    values = {name: [pm(i, *path) for i in infos] for name, path in names.items()}
    out: dict[str, Any] = {name: seed_stats(v) for name, v in values.items() if None not in v}
    rules = [f"rule/{r}" for r in rule_names]
    judge = {i["seed"]: i[split]["judge"]["balanced_acc_pm"] for i in infos}
    if rules and all(r in out for r in rules) and None not in judge.values():
        best = {i["seed"]: max(values[r][k] for r in rules) for k, i in enumerate(infos)}
        out["judge_minus_best_reply_rule"] = paired_difference(judge, best)
    return out


def plot_builds(agg: dict[str, Any], path: Path) -> Path:
    """Bars of ±1 balanced accuracy per held-out split: the judge (mean ± s.e. over builds,
    each build a dot), the better reply-only rule, the keyword judge and the base model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = [s for s in EVAL_SPLITS if s in agg]
    who = [("judge", "the judge"), ("rules", "a rule on the reply alone (the better one)"),
           ("heuristic", "keyword judge"), ("base", "the model it started from")]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.8 / len(who)
    for k, (key, label) in enumerate(who):
        xs, ys, es = [], [], []
        for j, split in enumerate(splits):
            side = agg["beside"][split]
            if key == "judge":
                st = agg[split]["balanced_acc_pm"]
                ax.scatter([j + (k - 1.5) * width] * len(agg["seeds"]),
                           [p[split]["balanced_acc_pm"] for p in agg["seeds"]], s=10,
                           color="black", zorder=3)
            elif key == "rules":
                rules = [v for n, v in side.items() if n.startswith("rule/")]
                st = max(rules, key=lambda r: r["mean"]) if rules else None
            else:
                st = side.get(key)
            if st is not None:
                xs.append(j + (k - 1.5) * width)
                ys.append(st["mean"])
                es.append(st["stderr"] or 0.0)
        if not xs:  # not measured (the base model with --no-base)
            continue
        ax.bar(xs, ys, width, yerr=es, capsize=3, label=label)
        for x, y in zip(xs, ys):  # the mean, beside its bar (the builds' dots sit on it)
            ax.text(x + width / 2, y + 0.01, f"{y:.2f}", ha="left", fontsize=7)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set(xticks=range(len(splits)), ylim=(0, 1.08), ylabel="±1 balanced accuracy (p₊ + p₋) / 2",
           xticklabels=[s.replace("_", " ") + (" = the users'" if s == "test" else "")
                        for s in splits],
           title=f"clawray judge-sft: {agg['builds']} builds, held-out wording")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
