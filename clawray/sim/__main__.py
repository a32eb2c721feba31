"""``python -m clawray.sim``: run simulated users against a server, evaluate, or measure.

    python -m clawray.sim run --base-url http://127.0.0.1:8000/v1 --users 4 --sessions 5
    python -m clawray.sim eval --base-url http://127.0.0.1:8000/v1 --n 100
    python -m clawray.sim measure --n 240 --turns 3     # offline base rates, no server

``measure`` samples the model directly with transformers (no Ray, no server), with the same
messages, system prompt, feedback and sampling settings as the users, to check a preference's
base rate before using it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter, defaultdict
from typing import Any

from clawray.models.loader import resolve_model_path
from clawray.sim.preferences import PREFERENCES, Preference, get_preference
from clawray.sim.users import (MESSAGE_TYPES, POOL_NAMES, SYSTEM_PROMPT, evaluate, follow_up,
                               make_request, run_users, satisfaction_rate, topic_words)


def _rate(xs: list[bool]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def measure(preference: Preference, model: str = "embedded:tiny", n: int = 240, turns: int = 3,
            seed: int = 0, temperature: float = 1.0, max_new_tokens: int = 48,
            batch: int = 60, pool: str = "train") -> dict[str, Any]:
    """Offline satisfaction rates on prompt pool ``pool``: ``n`` single-turn messages per type,
    and ``n`` sessions of ``turns`` judged turns with the feedback in the history, sampled
    with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"  # RoPE scores depend on relative positions only
    lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    torch.manual_seed(seed)
    rng = random.Random(f"measure/{seed}")

    def replies(convs: list[list[dict[str, str]]]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(convs), batch):
            texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                     for c in convs[i:i + batch]]
            enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
            with torch.no_grad():
                ids = lm.generate(**enc, do_sample=True, temperature=temperature, top_k=0,
                                  top_p=1.0, max_new_tokens=max_new_tokens,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            width = enc["input_ids"].shape[1]
            out += [tok.decode(row[width:], skip_special_tokens=True) for row in ids]
        return out

    system = {"role": "system", "content": SYSTEM_PROMPT}
    single: dict[str, Any] = {}
    for kind in MESSAGE_TYPES:
        texts = [make_request(rng, {kind: 1.0}, pool)[1] for _ in range(n)]
        got = replies([[system, {"role": "user", "content": t}] for t in texts])
        single[kind] = {"rate": _rate([preference.satisfied(r, topic_words(t, pool))
                                       for r, t in zip(got, texts)]),
                        "top_replies": Counter(got).most_common(3)}
    convs, kinds, asked = [], [], []
    for _ in range(n):
        kind, text = make_request(rng, pool=pool)
        convs.append([system, {"role": "user", "content": text}])
        kinds.append(kind)
        asked.append(text)
    by_turn, by_type, every = defaultdict(list), defaultdict(list), []
    for turn in range(1, turns + 1):
        for i, reply in enumerate(replies(convs)):
            topic = topic_words(asked[i], pool)
            ok = preference.satisfied(reply, topic)
            by_turn[turn].append(ok)
            by_type[(turn, kinds[i])].append(ok)
            every.append(ok)
            kinds[i], asked[i] = make_request(rng, pool=pool)
            convs[i] += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": follow_up(
                             preference.feedback(reply, ok, rng, topic), asked[i])}]
    return {"preference": preference.describe(), "model": model, "temperature": temperature,
            "n": n, "pool": pool, "single_turn": single,
            "sessions": {"all": _rate(every),
                         "by_turn": {t: _rate(v) for t, v in by_turn.items()},
                         "by_turn_and_type": {f"{t}/{k}": _rate(v)
                                              for (t, k), v in sorted(by_type.items())}}}


def _summary(interactions: list, wall_s: float) -> dict[str, Any]:
    judged = [i for i in interactions if i.satisfied is not None]
    types = sorted({i.message_type for i in judged})
    return {"requests": len(interactions), "judged": len(judged),
            "sessions": len({i.session_id for i in interactions}),
            "errors": sum(i.error is not None for i in interactions),
            "rate": satisfaction_rate(judged),
            "per_type": {k: satisfaction_rate([i for i in judged if i.message_type == k])
                         for k in types},
            "policy_versions": sorted({i.policy_version for i in interactions
                                       if i.policy_version is not None}),
            "mean_latency_s": (round(sum(i.latency_s for i in interactions) / len(interactions), 3)
                               if interactions else None),
            "wall_s": round(wall_s, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clawray.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "eval", "measure"):
        p = sub.add_parser(name)
        p.add_argument("--preference", default="brief", choices=sorted(PREFERENCES))
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--max-tokens", type=int, default=48)
        p.add_argument("--pool", choices=POOL_NAMES, default="test" if name == "eval" else "train",
                       help="prompt pool (train: what training users send; validation: for "
                       "choosing settings; test: held out, for reporting)")
        if name == "measure":
            p.add_argument("--model", default="embedded:tiny")
            p.add_argument("--n", type=int, default=240)
            p.add_argument("--turns", type=int, default=3)
            continue
        p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
        p.add_argument("--api-key", default=os.environ.get("CLAWRAY_API_KEY", "none"))
        p.add_argument("--model", default="clawray-tiny")
        if name == "run":
            p.add_argument("--users", type=int, default=4)
            p.add_argument("--sessions", type=int, default=None, help="sessions per user")
            p.add_argument("--duration", type=float, default=None, help="seconds, instead")
            p.add_argument("--turns", type=int, default=3)
        else:
            p.add_argument("--n", type=int, default=100)
            p.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    pref = get_preference(args.preference)
    common = dict(preference=pref, max_tokens=args.max_tokens, temperature=args.temperature)
    t0 = time.perf_counter()
    if args.cmd == "measure":
        out = measure(pref, args.model, args.n, args.turns, args.seed, args.temperature,
                      args.max_tokens, pool=args.pool)
    elif args.cmd == "run":
        if args.sessions is not None and args.duration is not None:
            ap.error("give --sessions or --duration, not both")
        sessions = 1 if args.sessions is None and args.duration is None else args.sessions
        inter = asyncio.run(run_users(args.base_url, args.api_key, args.model,
                                      num_users=args.users, sessions_per_user=sessions,
                                      duration_s=args.duration, turns_per_session=args.turns,
                                      seed=args.seed, pool=args.pool, **common))
        out = _summary(inter, time.perf_counter() - t0)
    else:
        res = asyncio.run(evaluate(args.base_url, args.api_key, args.model, n=args.n,
                                   seed=args.seed, concurrency=args.concurrency,
                                   pool=args.pool, **common))
        out = {"rate": res.rate, "n": res.n, "per_type": res.per_type, "errors": res.errors,
               "policy_versions": res.policy_versions,
               "wall_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps({"preference": pref.describe(), **out}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
