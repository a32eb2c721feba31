"""The NCCL weight sync into a served vLLM replica, end to end (step 3 of bench/gpu_check.sh).

Needs a CUDA machine with at least 2 GPUs (NCCL does not put two ranks of one group on one
GPU: the learner takes one, the replica's vLLM engine another); with fewer it writes a
``skipped`` report and exits 0, saying so. Never run in CI (no GPU) -- and, as of this
writing, never run at all: see docs/vllm.md.

    .venv/bin/python bench/gpu_nccl.py [--model FOLDER] [--rounds 3] [--out FILE]

One clawray app (colocated, one replica, vLLM created with ``weight_transfer: nccl``), a
learner actor holding the same model on its own GPU and ``VLLMNcclSync.for_app(cfg)``, driven
by the Trainer's own ``WeightPublisher(transport="nccl")``; for each round the learner perturbs
its weights, broadcasts them and the publisher waits until the replica serves the new version, while 4 client threads keep streaming requests. Checks: no request
failed, every round ended on the new version, and the replica's prompt log-probs equal the
learner's afterwards. Reports sync seconds per round and bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import openai
import ray
import torch

APP = "gpu-nccl"
KEY = "gpu-check-key"
PROMPT = [5, 17, 42, 99, 7, 250, 11, 64]
RESPONSE = [23, 8, 301, 77, 12, 5]


@ray.remote(num_gpus=1)
class NcclLearner:
    """The learner's side: the model on its own GPU, rank 0 of the NCCL group."""

    def __init__(self, model_path: str, cfg: dict) -> None:
        from transformers import AutoModelForCausalLM

        from clawray.config import ClawRayConfig
        from clawray.weights.nccl import VLLMNcclSync

        self.model = AutoModelForCausalLM.from_pretrained(model_path).cuda().eval()
        self.sync = VLLMNcclSync.for_app(ClawRayConfig.from_dict(cfg))

    def perturb(self, seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype) * 0.02)

    def send_nccl(self, version: int, app: str, ranks_per_replica: int) -> dict:
        """What the Trainer's learner rank 0 does (LearnerWorker.send_nccl)."""
        assert (app, ranks_per_replica) == (self.sync.app_name, self.sync.ranks_per_replica)
        self.sync.prepare(version)
        sent = self.sync.send({k: v.detach() for k, v in self.model.state_dict().items()},
                              version)
        return {"kind": "nccl", "bytes": int(sent["bytes"]), "seconds": float(sent["seconds"])}

    def logprobs(self) -> list[float]:
        with torch.no_grad():
            logits = self.model(torch.tensor([PROMPT + RESPONSE], device="cuda")).logits[0]
        lp = torch.log_softmax(logits.float(), dim=-1)
        return [lp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(RESPONSE)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--out", default="bench/results/gpu_nccl.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    if gpus < 2:
        reason = f"needs 2 CUDA GPUs (learner + replica), this machine has {gpus}"
        out.write_text(json.dumps({"skipped": reason}, indent=2))
        print(f"gpu_nccl: SKIPPED: {reason}", file=sys.stderr)
        return 0

    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.models.loader import policy_model_info
    from clawray.serve.app import build_app
    from clawray.weights.publisher import WeightPublisher

    cfg = (ClawRayConfig().model(path=args.model, device="cuda", dtype="auto")
           .inference(engine="vllm", weight_transfer="nccl", gpu_memory_utilization=0.5)
           .serving(api_keys=[KEY], record_sink=["jsonl"], replica_num_gpus=1,
                    records_path=f"/tmp/{APP}-turns.jsonl", default_max_tokens=16)
           .training(app=APP, learner_num_gpus=1))
    model_path = str(policy_model_info(cfg).path)
    ray.init(address="local", include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8765})
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    learner = NcclLearner.remote(model_path, cfg.to_dict())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:8765/{APP}/v1", api_key=KEY,
                           max_retries=0, timeout=120)
    stop, errors, done = threading.Event(), [], [0]

    def load(worker: int) -> None:
        while not stop.is_set():
            try:
                chunks = list(client.chat.completions.create(
                    model="clawray-tiny", max_tokens=16, stream=True,
                    messages=[{"role": "user", "content": f"hello from {worker}"}]))
                assert chunks[-1].choices[0].finish_reason is not None
                done[0] += 1
            except Exception as e:  # every failure is the finding
                errors.append(repr(e))

    threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    class RankZero:  # the LearnerGroup interface the Trainer's WeightPublisher drives
        def send_nccl(self, version: int, app: str, ranks: int) -> dict:
            return ray.get(learner.send_nccl.remote(version, app, ranks))

        def set_version(self, version: int) -> None:
            pass

    publisher = WeightPublisher(APP, lora=False, timeout_s=args.timeout_s, transport="nccl",
                                ranks_per_replica=cfg.inference_cfg.tensor_parallel_size)
    publisher.attach(RankZero())
    rounds = []
    try:
        for i in range(args.rounds):
            ray.get(learner.perturb.remote(100 + i))
            started = time.perf_counter()
            info = publisher.publish()
            rounds.append({"version": info["version"], "seconds": time.perf_counter() - started,
                           "send_seconds": info["send_s"], "bytes": info["bytes"],
                           "replicas": info["replicas"]})
            print(f"gpu_nccl: round {i + 1}: {rounds[-1]['seconds']:.3f} s, "
                  f"{rounds[-1]['bytes'] / 1e6:.1f} MB", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    served = serve.get_app_handle(APP).prompt_logprobs.remote(PROMPT, RESPONSE).result()
    want = ray.get(learner.logprobs.remote())
    diff = max(abs(a - b) for a, b in zip(served, want))
    report = {"gpus": gpus, "device": torch.cuda.get_device_name(0), "rounds": rounds,
              "requests": done[0], "failed_requests": len(errors), "errors": errors[:5],
              "max_logprob_diff": diff}
    out.write_text(json.dumps(report, indent=2))
    ok = (not errors and diff < 2e-2
          and all(set(r["replicas"].values()) == {r["version"]} for r in rounds))
    print(f"gpu_nccl: {'passed' if ok else 'FAILED'}: {done[0]} requests, {len(errors)} failed, "
          f"log-prob diff {diff:.2e}; report {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
