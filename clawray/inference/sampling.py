"""Token sampling and stop-string matching for the in-process (transformers) engine.

Kept apart from the scheduler so the rules (greedy at temperature 0, nucleus filtering, raw
log-probs, per-request seeded generators) can be read and tested without a model.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable, Sequence

import torch

# Golden-ratio odd constant: spreads (seed, completion index) pairs over the 63-bit seed space so
# completion 1 of seed s does not replay completion 0 of seed s + 1.
_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


def make_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator:
    """A private generator for one completion, so its samples ignore every other request.

    With a seed, completion ``index`` of a request is reproducible whatever else the engine is
    doing; without one the generator is seeded at random.
    """
    gen = torch.Generator(device=device)
    if seed is None:
        gen.manual_seed(random.getrandbits(63))
    else:
        gen.manual_seed((seed ^ (index * _SEED_MIX)) & _SEED_MASK)
    return gen


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """How to pick the next token of one sequence in a batched step."""

    temperature: float
    top_p: float
    generator: torch.Generator | None
    top_logprobs: int = 0  # alternatives to report per position (OpenAI's top_logprobs)
    # Penalties (OpenAI's and vLLM's meanings) and logit_bias, applied to the logits before
    # sampling; ``generated`` / ``prompt`` are the sequence's live id lists they read.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    generated: list[int] | None = None
    prompt: list[int] | None = None
    # Constrained decoding (grammar.RowGrammar): tokens the grammar refuses are masked out.
    grammar: Any = None

    @functools.cached_property
    def _prompt_set(self) -> torch.Tensor:
        """The prompt's distinct ids, once per sequence (agent prompts run to ~18k ids)."""
        return torch.tensor(sorted(set(self.prompt or [])), dtype=torch.long)

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """This row's logits (1-D) with its penalties and biases applied (a new tensor).

        In vLLM's order: logit_bias adds to the named ids; repetition (vLLM, CTRL): a positive
        logit of an id seen in the prompt or the output is divided by it, a negative one
        multiplied; frequency/presence (OpenAI): ``l[t] -= count(t) * frequency +
        (count(t) > 0) * presence`` over the generated ids.
        """
        out = logits.clone()
        generated = self.generated or []
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], device=out.device)
            out[ids] += torch.tensor([b for _, b in self.logit_bias], dtype=out.dtype,
                                     device=out.device)
        if self.repetition_penalty != 1.0:
            seen = self._prompt_set.to(out.device)
            if generated:
                seen = torch.cat([seen, torch.tensor(generated, device=out.device)])
            if seen.numel():
                vals = out[seen]
                out[seen] = torch.where(vals > 0, vals / self.repetition_penalty,
                                        vals * self.repetition_penalty)
        if (self.presence_penalty or self.frequency_penalty) and generated:
            counts = torch.bincount(torch.tensor(generated, device=out.device),
                                    minlength=out.shape[-1])[: out.shape[-1]].to(out.dtype)
            out -= counts * self.frequency_penalty + (counts > 0).to(out.dtype) * \
                self.presence_penalty
        return out


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of ``probs`` (1-D) outside the smallest set whose mass reaches ``top_p``.

    The most likely token always survives. The result is not renormalized (multinomial does not
    need it).
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep a token if the mass strictly before it is still below top_p.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_rows(
    logits: torch.Tensor, rows: Sequence[RowSampling]
) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
    """Pick one token per row of ``logits`` ([B, V]) and return it with its raw log-prob, and,
    for rows that ask for them, the ``top_logprobs`` most likely tokens with theirs.

    The log-prob is that of the unmodified model distribution (log_softmax at temperature 1,
    before penalties, biases, grammar masks and top-p), which is what the learner's importance ratio compares
    against; the settings that shaped the sampling travel with the record.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    chosen = torch.argmax(logits, dim=-1)
    for i, row in enumerate(rows):
        row_logits = row.adjust(logits[i]) if row.adjusts else logits[i]
        if row.grammar is not None:
            row_logits = row.grammar.mask(row_logits)
        if row.temperature == 0:
            if row.adjusts or row.grammar is not None:
                chosen[i] = torch.argmax(row_logits)
            continue
        probs = top_p_filter(torch.softmax(row_logits / row.temperature, dim=-1), row.top_p)
        chosen[i] = torch.multinomial(probs, 1, generator=row.generator)[0]
    picked = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    tops: list[list[tuple[int, float]] | None] = []
    for i, row in enumerate(rows):
        if row.top_logprobs > 0:
            values, ids = torch.topk(logp[i], min(row.top_logprobs, logp.shape[-1]))
            tops.append(list(zip(ids.tolist(), values.tolist())))
        else:
            tops.append(None)
    return chosen.tolist(), picked.tolist(), tops


class StopMatcher:
    """Finds the first stop string completed by the newest token of a response.

    Only a tail window of ids is decoded after each token: a stop string of ``k`` characters
    spans at most ``4k`` byte-level tokens, so the window sees every new match while decoding
    stays O(1) per token instead of O(response length).
    """

    def __init__(self, stop: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._decode = decode
        self._window = 4 * max((len(s) for s in self.stop), default=0) + 8

    def __bool__(self) -> bool:
        return bool(self.stop)

    def check(self, token_ids: list[int]) -> str | None:
        """The stop string that now appears in the decoded tail of ``token_ids``, if any."""
        if not self.stop:
            return None
        tail = self._decode(token_ids[-self._window :])
        hits = [(tail.find(s), s) for s in self.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        return min(hits)[1] if hits else None
