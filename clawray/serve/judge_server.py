"""JudgeServer: a second engine that writes judge votes and scores OPD teacher log-probs.

``JudgeCore`` does the work without Serve (tests use it directly); ``JudgeServer`` is the thin
Serve deployment around it. It has no HTTP routes: voters reach it through a deployment handle.

- ``judge_samples``: the chat-templated judge prompt goes to ONE engine call with ``n``
  samples, so the votes share a single prompt prefill (OpenClaw-RL makes ``n`` separate
  calls). Each sample keeps the exact prompt and output ids, their log-probs and the weights
  version, which is what co-training the judge as RLAnything's reward model needs; ``judge``
  returns only their texts.
- ``teacher_logprobs``: the hinted prompt is templated exactly like the policy's prompt (tools
  and generation prompt included) and the engine scores the student's sampled response ids as
  given: one log-prob per id, no re-tokenization, no padding.

A JudgeServer replica receives weights on its own channel, ``judge_channel(app)``
(``clawray/weights/control.py``), from the RM co-trainer (``clawray/rlanything/rm_cotrainer.py``);
``status()`` reports the version it serves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from clawray.config import ClawRayConfig
from clawray.inference.engine import Engine, SamplingParams
from clawray.inference.factory import make_engine
from clawray.models.loader import judge_model_info, judge_model_path, load_tokenizer
from clawray.names import judge_channel
from clawray.weights.receiver import WeightReceiver, start_receiver

logger = logging.getLogger(__name__)


class JudgeInputError(ValueError):
    """A judge or teacher request that cannot be served as given (e.g. too long)."""


class JudgeCore:
    """The judge model's engine and tokenizer, and the two things a judge is asked for.

    ``engine`` and ``tokenizer`` may be injected (tests, a shared engine); otherwise they are
    loaded from the judge model folder with the policy's inference settings.
    """

    def __init__(self, cfg: ClawRayConfig, engine: Engine | None = None,
                 tokenizer: Any = None) -> None:
        self.info = judge_model_info(cfg)
        model_cfg = cfg.model_cfg
        if judge_model_path(cfg):  # another model: its own context window and name
            model_cfg = model_cfg.model_copy(update={"path": str(self.info.path),
                                                     "max_model_len": None, "served_name": None})
        self.engine = engine if engine is not None else make_engine(
            model_cfg, cfg.inference_cfg, self.info)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.info.path)
        self.max_model_len = self.engine.max_model_len
        logger.info("judge engine ready for %s (context %d)", self.info.path, self.max_model_len)

    def template(self, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt ids of ``messages`` with a generation prompt, as the policy's ingress makes
        them (render to text, then encode without adding special tokens)."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise JudgeInputError(f"the chat template cannot render these messages: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def judge_samples(self, messages: list[dict[str, Any]], n: int, temperature: float,
                            max_tokens: int, seed: int | None = None,
                            structural_tag: str | None = None) -> list[dict[str, Any]]:
        """``n`` judge outputs for the judge prompt ``messages``, from one engine call, each as
        ``{text, prompt_ids, token_ids, logprobs, finish_reason, policy_version,
        policy_version_end}``: the exact ids the judge sampled (``text`` is their decoding
        without special tokens) and the raw log-probs of those ids under the weights version
        ``policy_version`` (``policy_version_end`` when a weight swap happened mid-way). With a
        ``seed`` the n samples are reproducible (evaluations); without one they are random.
        ``structural_tag``: the shape the outputs must take (judging/formats.py), enforced by
        the engine's constrained decoding."""
        prompt_ids = await asyncio.to_thread(self.template, messages)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise JudgeInputError(
                f"the judge prompt has {len(prompt_ids)} tokens but the judge model's context "
                f"window is {self.max_model_len}: shorten judge history (judge prompt "
                "max_history_chars) or use a judge model with a longer context")
        params = SamplingParams(n=n, temperature=temperature, max_tokens=min(max_tokens, room),
                                seed=seed, structural_tag=structural_tag)
        outputs = await self.engine.generate(prompt_ids, params)
        if len(outputs) != n:
            raise RuntimeError(f"the judge engine returned {len(outputs)} outputs for n={n}")
        return [{"text": self.tokenizer.decode(o.token_ids, skip_special_tokens=True),
                 "prompt_ids": list(prompt_ids), "token_ids": list(o.token_ids),
                 "logprobs": [float(x) for x in o.logprobs], "finish_reason": o.finish_reason,
                 "policy_version": int(o.policy_version),
                 "policy_version_end": o.policy_version_end}
                for o in sorted(outputs, key=lambda o: o.index)]

    async def judge(self, messages: list[dict[str, Any]], n: int, temperature: float,
                    max_tokens: int, structural_tag: str | None = None) -> list[str]:
        """The texts of ``judge_samples`` (PRM votes, OPD hints)."""
        return [s["text"] for s in await self.judge_samples(
            messages, n, temperature, max_tokens, structural_tag=structural_tag)]

    async def teacher_logprobs(self, messages: list[dict[str, Any]],
                               tools: list[dict[str, Any]] | None,
                               response_ids: list[int]) -> list[float]:
        """log p_teacher(response_ids[t] | templated ``messages``, response_ids[:t]) for each t.

        ``messages`` is the hinted student prompt; ``response_ids`` are the exact ids the policy
        sampled, so the result lines up one-to-one with the rollout log-probs.
        """
        response_ids = list(response_ids)
        prompt_ids = await asyncio.to_thread(self.template, messages, tools)
        total = len(prompt_ids) + len(response_ids)
        if total > self.max_model_len:
            raise JudgeInputError(
                f"teacher prompt ({len(prompt_ids)} tokens) + response ({len(response_ids)} "
                f"tokens) = {total} tokens exceeds the judge model's context window of "
                f"{self.max_model_len}")
        logprobs = await self.engine.prompt_logprobs(prompt_ids, response_ids)
        if len(logprobs) != len(response_ids):
            raise RuntimeError(
                f"the judge engine returned {len(logprobs)} teacher log-probs for "
                f"{len(response_ids)} response ids; they must align one-to-one")
        return [float(x) for x in logprobs]

    async def status(self) -> dict[str, Any]:
        """Model, engine load, and ``version``: the judge weights version it serves."""
        engine = await self.engine.status()
        receiver: WeightReceiver | None = getattr(self, "receiver", None)
        return {"model": str(self.info.path), "max_model_len": self.max_model_len,
                "engine": engine.engine, "running": engine.running, "waiting": engine.waiting,
                "version": engine.policy_version,
                "weights_error": receiver.error if receiver is not None else None}


@serve.deployment(name="JudgeServer")
class JudgeServer(JudgeCore):
    """A Serve replica wrapping one judge engine; reached only through deployment handles.

    It takes published RM weights from ``judge_channel(app)``, never from the policy's channel.
    """

    def __init__(self, config: dict) -> None:
        super().__init__(ClawRayConfig.from_dict(config).apply_log_level())
        self.receiver: WeightReceiver | None = start_receiver(self.engine, channel=judge_channel)

    def __del__(self) -> None:  # Serve calls it on shutdown: stop polling, deregister
        receiver = getattr(self, "receiver", None)  # None if the constructor failed early
        if receiver is not None:
            receiver.close()
