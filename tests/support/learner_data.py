"""Seeded sample rows for learner tests and benchmarks: real prompts of the embedded model's
chat template, responses sampled from it, rollout log-probs from the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import torch

from clawray.samples import make_row, rows_to_batch

QUESTIONS = ["hi there", "What is the capital of the moon?", "Please write me a poem.",
             "hello!", "How do trees grow?", "Summarize this file for me."]


def sampled_rows(model_path: str | Path, n: int, seed: int = 0, max_new: int = 12,
                 version: int = 0) -> pa.Table:
    """``n`` rl rows: reward +1 when the reply is short (<= 8 tokens), else -1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path)).eval()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=max_new,
                                 top_k=0, top_p=1.0, temperature=1.0,
                                 pad_token_id=tok.pad_token_id)
            resp = out[0, len(prompt):].tolist()
            logits = model(out).logits[0, len(prompt) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, out[0, len(prompt):, None])[:, 0]
        rows.append(make_row(sample_id=f"s{seed}-{i}", kind="rl", source="live",
                             session_id=f"sess{i}", turn=0, prompt_ids=prompt,
                             response_ids=resp, rollout_logprobs=lp.tolist(),
                             policy_version=version, loss_mask=[1] * len(resp),
                             reward=1.0 if len(resp) <= 8 else -1.0))
    return pa.Table.from_batches([rows_to_batch(rows)])
