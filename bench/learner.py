"""Learner throughput: clawray's DeepSpeed learner vs a plain PyTorch AdamW loop on the same
model and batches, packed vs padded batches, and weight-sync time vs an in-memory copy.

    .venv/bin/python bench/learner.py --quick        # smoke run, ~1 min on 2 cores
    .venv/bin/python bench/learner.py                # 64-row batches, 12 timed rounds
    .venv/bin/python bench/learner.py --model PATH   # any local HF causal LM folder
    .venv/bin/python bench/learner.py --model bundled:smollm2 --lora-rank 16   # LoRA, real model

Contenders (rows of the table), all on one model loaded from the same folder, all fed the same
seeded batches, all computing the same loss (``make_batch`` + ``policy_loss`` of clawray, clip
centred on the current log-probs, batch-mean reward baseline, grad clip, AdamW step):

    ds-zero0       ``LearnerCore.update`` (DeepSpeed ZeRO stage 0, one rank, gloo)
    ds-zero1       the same with ZeRO stage 1 (clawray's default)
    torch-packed   the baseline: the HF model, ``torch.optim.AdamW``, the same packed forward
                   (rows back to back, block-causal mask, ``logits_to_keep``), ``loss.backward``,
                   ``clip_grad_norm_``, ``step``: the only difference is the DeepSpeed engine
    torch-padded   the same plain loop on the rows right-padded to the longest row with an
                   attention mask; only the response positions reach the LM head, as in packed

With ``--lora-rank R`` every contender trains LoRA adapters only (peft's ``LoraConfig`` with
``lora_alpha``, ``target_modules`` as ``training.lora_targets``): the learner as
``training.lora_rank`` does, the baselines as plain torch + peft (``get_peft_model``).
Memory (``--memory``, on by default): each contender alone in a fresh process (spawned, so
no allocator reuses another's freed memory) builds itself and runs one update on the first
timed batch; reported are the process's resident set once built (``built_mb``: model,
optimizer state, DeepSpeed), its peak during the update sampled every 5 ms (``peak_mb``) and
the difference (``update_mb``: activations, gradients, optimizer step).

Contenders are interleaved: round ``i`` runs every contender once on batch ``i``, in an order
rotated by ``i``, so machine noise hits all of them alike, and a round in which other processes
took more than ``--max-foreign-pct`` of the CPU is run again after waiting for a quiet machine
(the least disturbed attempt is kept). Tokens/s counts real tokens only (prompt + response of
every row, no padding) over the wall time of the whole update call (batch building included);
the ratio to the baseline is given over all rounds and as the median of per-round ratios. Since every contender starts from the same weights and applies the
same updates, their weights must agree at the end: the largest difference to ``torch-packed``
is reported as a check that they did the same work.

Weight sync: a local Ray cluster (``address="local"``) serves the same model in a Serve app
(one colocated replica, JSONL records, no session pipeline); for several versions the ZeRO-1
learner takes one more update, then ``ObjectStoreSync`` (``LoraSync`` of the adapters with
``--lora-rank``) prepare + send + finalize of its state
dict (until the replica serves it) is timed against ``copy_baseline`` of the same state.

Writes ``bench/results/learner.json`` and ``bench/results/learner.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _report import apply_profile, machine_info, wait_for_quiet, write_results  # noqa: E402

TARGET_RATIO = 0.9  # DeepSpeed learner tokens/s vs the plain PyTorch loop (issue 4)
BASELINE = "torch-packed"
CONTENDERS = ("ds-zero0", "ds-zero1", "torch-packed", "torch-padded")
SYNC_APP = "bench-learner"
COPY_REPEATS = 5

SYSTEM = ("You are a helpful assistant working inside an agent app. Answer briefly, call a "
          "tool when the user asks for one, and say when you do not know.")
QUESTIONS = ("hi there", "What is the capital of the moon?", "Please write me a poem.",
             "hello!", "How do trees grow?", "Summarize this file for me.",
             "Can you list the files in this folder?", "Why is the sky blue?",
             "Draft an email to my team about the release.", "Thanks, now run the tests.")
ANSWERS = ("Hello! How can I help you today?", "OK, I understand.",
           "Good question. I am a small model, so my answers are short.",
           "Here is a short poem about the sea and the rain.", "Done. All tests passed.")


# ---------------------------------------------------------------------------- batches

def make_rows(model_path: str | Path, n: int, seed: int, max_new: int) -> "pa.Table":
    """``n`` rl rows like live agent turns: a chat of 0-3 earlier exchanges (with the system
    prompt half of the time), a response sampled from the model (temperature 1, up to
    ``max_new`` tokens) and its rollout log-probs from the same weights; reward +1 for a short
    reply, -1 otherwise. Row lengths vary, as live turns do (that is what padding wastes)."""
    import pyarrow as pa
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawray.samples import make_row, rows_to_batch

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(0, 3)):
            msgs += [{"role": "user", "content": rng.choice(QUESTIONS)},
                     {"role": "assistant", "content": rng.choice(ANSWERS)}]
        msgs.append({"role": "user", "content": rng.choice(QUESTIONS)})
        prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=True,
                                 max_new_tokens=rng.randint(max(1, max_new // 4), max_new),
                                 top_k=0, top_p=1.0, temperature=1.0,
                                 pad_token_id=tok.pad_token_id)
            resp = out[0, len(prompt):].tolist()
            logits = model(out).logits[0, len(prompt) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, out[0, len(prompt):, None])[:, 0]
        rows.append(make_row(sample_id=f"b{seed}-{i}", kind="rl", source="live",
                             session_id=f"sess{i}", turn=len(msgs) // 2, prompt_ids=prompt,
                             response_ids=resp, rollout_logprobs=lp.tolist(), policy_version=0,
                             loss_mask=[1] * len(resp),
                             reward=1.0 if len(resp) <= max_new // 2 else -1.0))
    return pa.Table.from_batches([rows_to_batch(rows)])


def make_batches(pool: "pa.Table", batch_size: int, count: int, seed: int) -> list:
    """``count`` batches of ``batch_size`` rows drawn from ``pool`` (seeded, no repeats within
    a batch), each one contiguous Arrow table as the learner receives it from the buffer."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    size = min(batch_size, pool.num_rows)
    return [pa.Table.from_batches(pool.take(pa.array(np.sort(
        rng.choice(pool.num_rows, size, replace=False)))).combine_chunks().to_batches())
        for _ in range(count)]


def batch_shape(table: "pa.Table") -> dict[str, float]:
    """Real tokens, the padded size and padding waste of one batch."""
    lengths = (np.asarray(table.column("prompt_ids").combine_chunks().value_lengths())
               + np.asarray(table.column("response_ids").combine_chunks().value_lengths()))
    padded = int(lengths.max()) * len(lengths)
    return {"rows": float(len(lengths)), "tokens": float(lengths.sum()),
            "response_tokens": float(np.asarray(
                table.column("response_ids").combine_chunks().value_lengths()).sum()),
            "min_len": float(lengths.min()), "max_len": float(lengths.max()),
            "mean_len": float(lengths.mean()),
            "padded_slots": float(padded), "padding_waste": float(padded / lengths.sum() - 1)}


# ---------------------------------------------------------------------------- plain PyTorch

class TorchLearner:
    """The baseline: clawray's loss on the HF model with ``torch.optim.AdamW``, no DeepSpeed.

    Mirrors one ``LearnerCore.update`` with one mini-batch and ``micro_batches`` accumulation
    steps: the same rows per micro-batch, the same loss denominator (the step's masked token
    count), the same clip centre (current log-probs, detached), the same grad clip."""

    def __init__(self, model_path: str | Path, cfg: Any, padded: bool) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg, self.padded = cfg, padded
        self.loss_cfg = cfg.loss
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.model.config.use_cache = False
        self.trunk = self.model.base_model  # the transformer without its LM head
        if cfg.lora_rank > 0:  # plain peft, configured as the learner configures it
            from clawray.learner.learner import with_lora

            self.model = with_lora(self.model, cfg)
        self.attn = getattr(self.model.config, "_attn_implementation", "sdpa") or "sdpa"
        self.pad_id = self.model.config.pad_token_id or 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)

    def _forward_packed(self, pb: Any) -> Any:
        from clawray.learner.learner import packed_logprobs

        return packed_logprobs(self.model, pb, max_tokens=self.cfg.max_pack_tokens,
                               flash=self.attn.startswith("flash"))[0]

    def _forward_padded(self, pb: Any) -> Any:
        """Rows right-padded to the longest, a [B, L] attention mask; the trunk runs on every
        slot, the LM head only on the response positions (as ``logits_to_keep`` does)."""
        import torch

        cu = pb.cu_seqlens
        lengths = torch.diff(cu)
        rows, width = pb.num_seqs, int(lengths.max())
        real = torch.arange(width)[None, :] < lengths[:, None]
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.int64)
        input_ids[real] = pb.input_ids  # row-major order is the packed order
        hidden = self.trunk(input_ids=input_ids, attention_mask=real.long(),
                            use_cache=False).last_hidden_state
        local = pb.score_positions - cu[pb.seq_index]
        picked = hidden.reshape(rows * width, -1)[pb.seq_index * width + local]
        logits = self.model.get_output_embeddings()(picked).float()
        return torch.log_softmax(logits, -1).gather(-1, pb.target_ids[:, None])[:, 0]

    def update(self, data: Any) -> dict[str, float]:
        import torch

        from clawray.learner.batch import center_rewards, loss_token_count, make_batch, shard_rows
        from clawray.learner.losses import policy_loss

        self.model.train()
        if self.cfg.loss.reward_baseline == "batch_mean":
            data = center_rewards(data)
        norm = float(loss_token_count(data))
        gas = self.cfg.micro_batches
        tokens = 0
        loss_sum = 0.0
        for k in range(gas):
            lo, hi = shard_rows(data.num_rows, gas, k)
            micro = data.slice(lo, hi - lo)
            if not micro.num_rows or not loss_token_count(micro):
                continue
            pb = make_batch(micro, self.loss_cfg)
            tokens += pb.num_tokens
            lp = self._forward_padded(pb) if self.padded else self._forward_packed(pb)
            loss, metrics = policy_loss(lp, pb.rollout_logprobs, pb.advantages, pb.mask,
                                        pb.seq_index, pb.num_seqs, self.loss_cfg,
                                        proximal_logprobs=lp.detach(), norm=norm)
            loss.backward()
            loss_sum += metrics["loss"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            self.params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum, "packed_tokens": float(tokens), "grad_norm": grad_norm}

    @property
    def module(self) -> Any:
        return self.model


# ---------------------------------------------------------------------------- throughput

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_contenders(names: list[str], model_path: Path, args: argparse.Namespace
                    ) -> dict[str, Any]:
    from clawray.config import TrainingConfig
    from clawray.learner.learner import LearnerCore, init_distributed

    init_distributed(0, 1, "127.0.0.1", free_port())
    base = {"lr": args.lr, "micro_batches": args.micro_batches, "seed": args.seed,
            "max_pack_tokens": args.max_pack_tokens, "lora_rank": args.lora_rank,
            "lora_alpha": args.lora_alpha}
    out: dict[str, Any] = {}
    for name in names:
        if name.startswith("ds-zero"):
            out[name] = LearnerCore(model_path, TrainingConfig(
                zero_stage=int(name.removeprefix("ds-zero")), **base))
        elif name in ("torch-packed", "torch-padded"):
            out[name] = TorchLearner(model_path, TrainingConfig(**base),
                                     padded=name == "torch-padded")
        else:
            raise SystemExit(f"unknown contender {name!r}: use any of {', '.join(CONTENDERS)}")
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, every process)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class PeakRSS:
    """The process's largest resident set while the block runs, sampled every 5 ms by a
    thread (CPU memory has no allocator counter like ``torch.cuda.max_memory_allocated``)."""

    def __enter__(self) -> "PeakRSS":
        import threading

        import psutil

        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def timed_update(learner: Any, table: Any) -> dict[str, float]:
    """One whole update call: wall seconds, real tokens, loss, and the share of the machine's
    CPU that other processes took meanwhile (``foreign_pct``, the noise indicator)."""
    busy0, own0, t0 = machine_busy_s(), own_cpu_s(), time.perf_counter()
    raw = learner.update(table)
    wall = time.perf_counter() - t0
    foreign = max(0.0, (machine_busy_s() - busy0) - (own_cpu_s() - own0))
    return {"seconds": wall, "tokens": raw["packed_tokens"], "loss": raw["loss"],
            "foreign_pct": 100.0 * foreign / (wall * (os.cpu_count() or 1))}


def _memory_of_one(name: str, model_path: str, batch_ipc: bytes, args: argparse.Namespace
                   ) -> dict[str, float]:
    """In a fresh process: build ``name``, run one update, report its memory (MiB)."""
    import psutil
    import pyarrow as pa

    table = pa.ipc.open_stream(batch_ipc).read_all()
    learner = make_contenders([name], Path(model_path), args)[name]
    built = psutil.Process().memory_info().rss
    with PeakRSS() as rss:
        learner.update(table)
    return {"built_mb": round(built / 2**20, 1), "peak_mb": round(rss.peak / 2**20, 1),
            "update_mb": round((rss.peak - built) / 2**20, 1)}


def measure_memory(names: list[str], model_path: Path, table: Any, args: argparse.Namespace,
                   log: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Each contender's memory, each alone in a fresh spawned process, one after another."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    batch_ipc = sink.getvalue().to_pybytes()
    out = {}
    for name in names:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            out[name] = pool.submit(_memory_of_one, name, str(model_path), batch_ipc,
                                    args).result()
        log(f"  {name}: {out[name]['built_mb']:.0f} MiB built, peak {out[name]['peak_mb']:.0f} "
            f"MiB in an update (+{out[name]['update_mb']:.0f})")
    return out


def measure_throughput(contenders: dict[str, Any], batches: list, args: argparse.Namespace,
                       log: Callable[[str], None]) -> dict[str, Any]:
    """Every contender once per batch (a round), in an order rotated per round; the first
    ``args.warmup`` rounds are untimed. A round in which other processes took more than
    ``args.max_foreign_pct`` of the CPU is run again (up to ``args.retries`` times, after waiting
    for a quiet machine) and the least disturbed attempt is kept. Every contender runs every
    attempt, so all of them apply the same sequence of updates."""
    names = list(contenders)
    rounds: list[dict[str, Any]] = []
    for i, table in enumerate(batches):
        order = names[i % len(names):] + names[:i % len(names)]
        warm = i < args.warmup
        best: dict[str, Any] | None = None
        for attempt in range(1 if warm else 1 + args.retries):
            if attempt:
                log(f"    others took {best['foreign_pct']:.0f}% of the CPU: again")
                wait_for_quiet(args.quiet_wait_s, log)
            runs = {name: timed_update(contenders[name], table) for name in order}
            foreign = max(r["foreign_pct"] for r in runs.values())
            if best is None or foreign < best["foreign_pct"]:
                best = {"runs": runs, "foreign_pct": foreign, "attempt": attempt + 1}
            if foreign <= args.max_foreign_pct:
                break
        best["attempts"] = attempt + 1
        if warm:
            log(f"  warm-up {i + 1}/{args.warmup}")
            continue
        rounds.append(best)
        log(f"  round {len(rounds)}/{len(batches) - args.warmup} (others' CPU "
            f"{best['foreign_pct']:.0f}%, attempt {best['attempt']}/{best['attempts']}): " +
            "  ".join(f"{n} {best['runs'][n]['tokens'] / best['runs'][n]['seconds']:.0f}"
                      for n in names) + " tok/s")
    results = []
    for name in names:
        runs = [r["runs"][name] for r in rounds]
        tps = [r["tokens"] / r["seconds"] for r in runs]
        total_s = sum(r["seconds"] for r in runs)
        row = {
            "contender": name, "rounds": len(runs),
            "tokens": sum(r["tokens"] for r in runs), "seconds": round(total_s, 4),
            "tokens_per_s": round(sum(r["tokens"] for r in runs) / total_s, 1),
            "tokens_per_s_median": round(float(np.median(tps)), 1),
            "tokens_per_s_min": round(float(min(tps)), 1),
            "tokens_per_s_max": round(float(max(tps)), 1),
            "seconds_per_update_median": round(float(np.median([r["seconds"] for r in runs])), 4),
            "foreign_cpu_pct_max": round(max(r["foreign_pct"] for r in runs), 1),
            "last_loss": runs[-1]["loss"],
        }
        if BASELINE in names:  # paired: the baseline's time over this one's, round by round
            row["ratio_paired_median"] = round(float(np.median(
                [r["runs"][BASELINE]["seconds"] / r["runs"][name]["seconds"] for r in rounds])), 3)
        results.append(row)
    return {"results": results,
            "rounds": [{"foreign_cpu_pct": round(r["foreign_pct"], 1), "attempt": r["attempt"],
                        "attempts": r["attempts"],
                        "tokens_per_s": {n: round(r["runs"][n]["tokens"] / r["runs"][n]["seconds"],
                                                  1) for n in names}} for r in rounds],
            "disturbed_rounds": sum(r["foreign_pct"] > args.max_foreign_pct for r in rounds)}


def weight_agreement(contenders: dict[str, Any]) -> dict[str, float]:
    """Largest absolute weight difference of each contender to the baseline after the run."""
    import torch

    if BASELINE not in contenders:
        return {}
    ref = contenders[BASELINE].module.state_dict()
    out = {}
    for name, learner in contenders.items():
        if name == BASELINE:
            continue
        state = learner.module.state_dict()
        out[name] = max(float((state[k].float() - v.float()).abs().max()) for k, v in ref.items()
                        if k in state and torch.is_floating_point(v))
    return out


# ---------------------------------------------------------------------------- weight sync

def measure_sync(core: Any, model_path: Path, batches: list, versions: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """The learner's weights (its state dict, or its LoRA adapters) synced into a running Serve
    app through the object store, against an in-memory copy of the same tensors."""
    import ray
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app
    from clawray.weights.control import get_app_control
    from clawray.weights.sync import LoraSync, ObjectStoreSync, copy_baseline

    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="clawray-bench-learner-")
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    from clawray.apps.launch import init_local_ray

    init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False,
                   logging_level="WARNING", namespace="bench")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        cfg = (ClawRayConfig().model(path=str(model_path)).inference(engine="hf")
               .serving(record_sink=["jsonl"], records_path=f"{tmp}/turns.jsonl",
                        replica_num_cpus=0.5, default_max_tokens=8))
        serve.run(build_app(cfg), name=SYNC_APP, route_prefix=f"/{SYNC_APP}")
        control = get_app_control(SYNC_APP)
        deadline = time.time() + 120
        while not any(r["live"] and r["weights"]
                      for r in ray.get(control.status.remote())["replicas"].values()):
            if time.time() > deadline:
                raise TimeoutError(f"no live replica: {ray.get(control.status.remote())}")
            time.sleep(0.1)
        log(f"  Serve app up in {time.perf_counter() - started:.1f} s")
        # LoRA: the adapters as the payload (the replica merges them; vLLM loads a LoRA request)
        sync = LoraSync(SYNC_APP) if core.lora else ObjectStoreSync(SYNC_APP)
        version = int(ray.get(control.status.remote())["version"])
        rounds = []
        for i in range(versions):
            core.update(batches[i % len(batches)])  # a new state per version, untimed
            t0 = time.perf_counter()
            _, state = core.sync_payload()
            payload_s = time.perf_counter() - t0
            tensors = state["state"] if core.lora else state
            version += 1
            # The floor: the same bytes copied in memory (median of a few: it is sub-millisecond
            # for a small model, and the first copy after an update pays fresh page faults).
            copies = [copy_baseline(tensors) for _ in range(COPY_REPEATS)]
            copy = {"bytes": copies[0]["bytes"],
                    "seconds": float(np.median([c["seconds"] for c in copies])),
                    "first_s": copies[0]["seconds"]}
            t0 = time.perf_counter()
            sync.prepare(version)
            sync.send(state, version)
            info = sync.finalize(version, timeout_s=120)
            total = time.perf_counter() - t0
            rounds.append({"version": version, "bytes": info["bytes"], "seconds": total,
                           "send_s": info["send_s"], "apply_s": info["apply_s"],
                           "payload_s": payload_s, "copy_s": copy["seconds"],
                           "copy_first_s": copy["first_s"],
                           "copy_bytes": copy["bytes"], "replicas": len(info["replicas"])})
            log(f"  version {version}: sync {1000 * total:.1f} ms (send "
                f"{1000 * info['send_s']:.1f}, apply {1000 * info['apply_s']:.1f}), copy "
                f"{1000 * copy['seconds']:.2f} ms, {info['bytes'] / 2**20:.1f} MiB")
        served = serve.get_app_handle(SYNC_APP).weights_version.remote().result()
    finally:
        ray.shutdown()  # ends Serve with the cluster (serve.shutdown() would drain ~30 s)
        shutil.rmtree(tmp, ignore_errors=True)
    timed = rounds[1:] if len(rounds) > 1 else rounds  # the first pays one-off costs
    med = {k: float(np.median([r[k] for r in timed]))
           for k in ("seconds", "send_s", "apply_s", "payload_s", "copy_s")}
    return {
        "method": type(sync).__name__,
        "rounds": rounds, "bytes": rounds[-1]["bytes"], "copy_bytes": rounds[-1]["copy_bytes"],
        "served_version": served["replica"], "median_over": len(timed),
        "sync_s_median": round(med["seconds"], 5), "send_s_median": round(med["send_s"], 5),
        "apply_s_median": round(med["apply_s"], 5),
        "payload_s_median": round(med["payload_s"], 5), "copy_s_median": round(med["copy_s"], 6),
        "sync_vs_copy": round(med["seconds"] / med["copy_s"], 1) if med["copy_s"] else None,
        "sync_mb_per_s": round(rounds[-1]["bytes"] / 2**20 / med["seconds"], 1),
        "copy_mb_per_s": round(rounds[-1]["copy_bytes"] / 2**20 / med["copy_s"], 1)
        if med["copy_s"] else None,
    }


# ---------------------------------------------------------------------------- report

def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Ratios against the baseline, packed vs padded, the target check."""
    by = {r["contender"]: r for r in report["throughput"]["results"]}
    base = by.get(BASELINE)
    out: dict[str, Any] = {"baseline": BASELINE, "target_ratio": TARGET_RATIO, "ratios": {}}
    if base:
        for name, r in by.items():
            out["ratios"][name] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        ds = {n: out["ratios"][n] for n in by if n.startswith("ds-")}
        out["ds_vs_torch"] = ds
        out["ratios_paired_median"] = {n: r.get("ratio_paired_median") for n, r in by.items()}
        out["target_met"] = {n: v >= TARGET_RATIO for n, v in ds.items()}
    if base and "torch-padded" in by:
        out["packed_vs_padded"] = round(base["tokens_per_s"] / by["torch-padded"]["tokens_per_s"],
                                        3)
        out["packed_vs_padded_paired_median"] = round(
            1.0 / by["torch-padded"]["ratio_paired_median"], 3)
    return out


def print_table(report: dict[str, Any]) -> None:
    s = report["summary"]
    shape = report["batches"]
    print(f"\n{report['settings']['model_name']}: {shape['rows_per_batch']} rows/batch, "
          f"{shape['tokens_mean']:.0f} real tokens/batch (rows {shape['len_min']}-"
          f"{shape['len_max']} tokens), padding waste {shape['padding_waste_mean']:.0%}")
    lora = report["settings"].get("lora_rank", 0)
    mem = report.get("memory", {})
    print(f"training {'LoRA rank ' + str(lora) + ' adapters' if lora else 'all weights'}; "
          f"memory: each contender alone in a fresh process, its peak resident set in one "
          f"update and the update's growth over the built learner")
    print(f"{'contender':<14}{'tok/s':>10}{'median':>10}{'min':>9}{'max':>9}{'s/update':>10}"
          f"{'vs ' + BASELINE:>17}{'paired':>8}{'peak MiB':>10}{'update':>8}")
    for r in report["throughput"]["results"]:
        ratio = s["ratios"].get(r["contender"])
        paired = r.get("ratio_paired_median")
        print(f"{r['contender']:<14}{r['tokens_per_s']:>10.0f}{r['tokens_per_s_median']:>10.0f}"
              f"{r['tokens_per_s_min']:>9.0f}{r['tokens_per_s_max']:>9.0f}"
              f"{r['seconds_per_update_median']:>10.3f}"
              f"{'-' if ratio is None else f'{ratio:.2f}x':>17}"
              f"{'-' if paired is None else f'{paired:.2f}x':>8}"
              f"{mem.get(r['contender'], {}).get('peak_mb', float('nan')):>10.0f}"
              f"{mem.get(r['contender'], {}).get('update_mb', float('nan')):>8.0f}")
    t = report["throughput"]
    print(f"{len(t['rounds'])} rounds, {t['disturbed_rounds']} still disturbed (others took "
          f"> {report['settings']['max_foreign_pct']:.0f}% of the CPU); 'paired' is the median "
          f"of per-round ratios")
    for name, met in s.get("target_met", {}).items():
        print(f"target {name} >= {TARGET_RATIO:.2f}x {BASELINE}: "
              f"{s['ratios'][name]:.2f}x {'met' if met else 'NOT met'}")
    if "packed_vs_padded" in s:
        print(f"packed vs padded (plain PyTorch): {s['packed_vs_padded']:.2f}x tokens/s "
              f"(paired {s['packed_vs_padded_paired_median']:.2f}x)")
    agree = report["throughput"].get("max_weight_diff_vs_baseline", {})
    if agree:
        print("weights after the run, max |diff| to " + BASELINE + ": " +
              ", ".join(f"{n} {v:.1e}" for n, v in agree.items()))
    sync = report.get("sync")
    if sync:
        print(f"\nweight sync ({sync['bytes'] / 2**20:.2f} MiB, median of {sync['median_over']}):"
              f" {sync['method']} {1000 * sync['sync_s_median']:.1f} ms (send "
              f"{1000 * sync['send_s_median']:.1f}, apply {1000 * sync['apply_s_median']:.1f}) vs "
              f"in-memory copy {1000 * sync['copy_s_median']:.2f} ms: {sync['sync_vs_copy']}x; "
              f"state dict from the learner {1000 * sync['payload_s_median']:.2f} ms")


def save_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["throughput"]["results"]
    s = report["summary"]
    sync = report.get("sync")
    fig, axes = plt.subplots(1, 2 if sync else 1, figsize=(13 if sync else 7, 4.6),
                             squeeze=False)
    ax = axes[0][0]
    names = [r["contender"] for r in rows]
    colors = ["tab:blue" if n.startswith("ds-") else "tab:grey" if n == BASELINE
              else "tab:orange" for n in names]
    bars = ax.bar(names, [r["tokens_per_s"] for r in rows], color=colors)
    ax.errorbar(range(len(rows)), [r["tokens_per_s"] for r in rows],
                yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
                      [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows]],
                fmt="none", ecolor="black", capsize=3, lw=0.8)
    ax.bar_label(bars, labels=[f"{r['tokens_per_s']:.0f}\n{s['ratios'].get(r['contender'], 0):.2f}x"
                               for r in rows], label_type="center", color="white",
                 fontsize=9, fontweight="bold")
    if BASELINE in names:
        base = rows[names.index(BASELINE)]["tokens_per_s"]
        ax.axhline(TARGET_RATIO * base, color="red", ls="--", lw=0.8,
                   label=f"target {TARGET_RATIO:.1f}x {BASELINE}")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, 1.25 * max(r["tokens_per_s_max"] for r in rows))
    b = report["batches"]
    ax.set_title(f"learner tokens/s (real tokens; min-max bars), {b['rows_per_batch']} rows, "
                 f"padding waste {b['padding_waste_mean']:.0%}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    if sync:
        ax = axes[0][1]
        labels = ["in-memory copy", "state dict\nfrom learner", "send\n(ray.put+publish)",
                  "apply\n(replica loads)", "sync total"]
        values = [1000 * sync[k] for k in ("copy_s_median", "payload_s_median", "send_s_median",
                                             "apply_s_median", "sync_s_median")]
        bars = ax.bar(labels, values, color=["tab:grey", "tab:green", "tab:blue", "tab:blue",
                                             "tab:purple"])
        ax.bar_label(bars, labels=[f"{v:.2f} ms" for v in values], fontsize=8, padding=2)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale), median")
        ax.set_title(f"weight sync of {sync['bytes'] / 2**20:.2f} MiB: {sync['method']} = "
                     f"{sync['sync_vs_copy']}x an in-memory copy", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    m = report["machine"]
    fig.suptitle(f"clawray learner - {report['settings']['model_name']}, {m['logical_cpus']} CPUs, "
                 f"torch {m['versions']['torch']}, deepspeed {m['versions']['deepspeed']}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main

def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    import importlib.metadata as md

    import torch


    machine = machine_info()
    machine["versions"].update({p: md.version(p) for p in ("torch", "deepspeed", "pyarrow")})
    machine["torch_threads"] = torch.get_num_threads()
    from clawray.models.loader import resolve_model_path

    model_path = resolve_model_path(args.model)  # a folder, embedded:tiny (default), bundled:…
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    t0 = time.perf_counter()
    pool = make_rows(model_path, args.pool, args.seed, args.max_new)
    batches = make_batches(pool, args.batch_size, args.warmup + args.iterations, args.seed)
    shapes = [batch_shape(b) for b in batches]
    log(f"{len(batches)} batches of {args.batch_size} rows from a pool of {args.pool} "
        f"({time.perf_counter() - t0:.1f} s to sample)")
    report: dict[str, Any] = {
        "benchmark": "learner", "machine": machine,
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"},
                     "model_path": str(model_path), "model_name": model_path.name,
                     "contenders": names},
        "batches": {
            "rows_per_batch": int(shapes[0]["rows"]),
            "tokens_mean": float(np.mean([s["tokens"] for s in shapes])),
            "response_tokens_mean": float(np.mean([s["response_tokens"] for s in shapes])),
            "len_min": int(min(s["min_len"] for s in shapes)),
            "len_max": int(max(s["max_len"] for s in shapes)),
            "mean_len": float(np.mean([s["mean_len"] for s in shapes])),
            "padding_waste_mean": float(np.mean([s["padding_waste"] for s in shapes])),
            "tokens_per_batch": [int(s["tokens"]) for s in shapes],  # warm-up batches first
        },
    }
    contenders = make_contenders(names, model_path, args)
    n_params = sum(p.numel() for p in next(iter(contenders.values())).module.parameters())
    report["settings"]["model_parameters"] = int(n_params)
    log(f"contenders {', '.join(names)} on {model_path.name} ({n_params / 1e6:.2f} M parameters)")
    machine["load_avg_start"] = [round(x, 2) for x in os.getloadavg()]
    busy = wait_for_quiet(args.quiet_wait_s, log)
    log(f"measuring (machine {busy:.0f}% busy before the start)")
    report["throughput"] = measure_throughput(contenders, batches, args, log)
    report["throughput"]["max_weight_diff_vs_baseline"] = weight_agreement(contenders)
    if args.memory:
        log("memory, each contender alone in a fresh process:")
        report["memory"] = measure_memory(names, model_path, batches[args.warmup], args, log)
    machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["summary"] = summarize(report)
    if args.sync_versions:
        core = contenders.get("ds-zero1") or next(
            (c for n, c in contenders.items() if n.startswith("ds-")), None)
        if core is None:
            raise SystemExit("the weight-sync measurement needs a ds-zero* contender")
        for name in list(contenders):  # free the others' memory before Ray starts
            if contenders[name] is not core:
                del contenders[name]
        log("weight sync:")
        report["sync"] = measure_sync(core, model_path, batches, args.sync_versions, log)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 16-row batches, 1 warm-up + 2 timed rounds, 2 syncs")
    p.add_argument("--model", default=None,
                   help="a local HF model folder or bundled:smollm2 (default: the embedded "
                   "tiny model)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank (every contender); 0: all weights")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each contender's memory in a process of its own (default: "
                   "on; off with --quick)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--batch-size", type=int, default=None, help="rows per batch (default 64)")
    p.add_argument("--pool", type=int, default=None, help="distinct rows sampled (default 192)")
    p.add_argument("--max-new", type=int, default=32, help="most response tokens per row")
    p.add_argument("--iterations", type=int, default=None, help="timed rounds (default 12)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2)")
    p.add_argument("--max-pack-tokens", type=int, default=2048,
                   help="tokens per packed forward pass (training.max_pack_tokens)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="gradient-accumulation pieces per update (every contender)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-foreign-pct", type=float, default=10.0,
                   help="a round where others took more of the CPU is run again")
    p.add_argument("--retries", type=int, default=None,
                   help="repeats of a disturbed round (default 3; 0 with --quick)")
    p.add_argument("--quiet-wait-s", type=float, default=None,
                   help="longest wait for a quiet machine (default 60; 0 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-versions", type=int, default=None,
                   help="weight-sync rounds (default 6; 0 skips the sync measurement)")
    p.add_argument("--out", type=Path, default=RESULTS / "learner.json")
    args = p.parse_args(argv)
    quick = {"batch_size": 16, "pool": 32, "iterations": 2, "warmup": 1, "sync_versions": 2,
             "retries": 0, "quiet_wait_s": 0.0, "memory": False}
    full = {"batch_size": 64, "pool": 192, "iterations": 12, "warmup": 2, "sync_versions": 6,
            "retries": 3, "quiet_wait_s": 60.0, "memory": True}
    apply_profile(args, args.quick, quick, full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return write_results(run_benchmark(args), args.out, print_table, save_plot)


if __name__ == "__main__":
    raise SystemExit(main())
