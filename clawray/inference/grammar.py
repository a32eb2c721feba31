"""Constrained decoding for the transformers engine, with xgrammar (the library vLLM uses).

A request's ``SamplingParams.structural_tag`` (xgrammar's structural-tag JSON: JSON answers,
tool calls in the chat template's markup) is compiled once per distinct tag against the
engine's tokenizer, then each completion gets its own matcher. Before every sampling step the
matcher's token bitmask sends the logits of every token the grammar refuses to -inf; after it,
the sampled token advances the matcher. When the grammar is complete the only tokens left are
the end-of-sequence ids, so a constrained completion ends like any other ("stop").

Log-probs stay those of the raw model distribution (the engine's convention); the structural
tag travels with the record's sampling settings, so the behaviour policy is described exactly.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable

import torch

from clawray.inference.engine import EngineError

try:  # xgrammar ships with vLLM and is a clawray dependency; without it no constraint is served
    import xgrammar as xgr
except ImportError:  # pragma: no cover - exercised only on a broken install
    xgr = None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix (``[06:15:31] /project/….cc:4950: ``)."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


@functools.lru_cache(maxsize=256)
def check_structural_tag(structural_tag: str) -> None:
    """Raise an EngineError (HTTP 400) with xgrammar's reason when the tag cannot be enforced
    (the vLLM engine checks before submitting: vLLM's own message loses the reason)."""
    if xgr is None:
        raise EngineError("constrained decoding needs the xgrammar package")
    try:
        xgr.Grammar.from_structural_tag(structural_tag)
    except Exception as e:
        raise EngineError(f"the requested output format cannot be enforced: "
                          f"{_reason(e)}") from None


class RowGrammar:
    """One completion's position in its grammar."""

    def __init__(self, compiled: Any, vocab_size: int, stop_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1-D, one row) with every token the grammar refuses set to -inf."""
        out = logits.clone().unsqueeze(0)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(out, self.bitmask.to(out.device))
        return out[0]

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar refuses it (never after ``mask``)."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class Grammars:
    """Compiles structural tags for one tokenizer (thread-safe; xgrammar caches compiled tags
    up to ``cache_bytes``)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int],
                 cache_bytes: int = 64 << 20) -> None:
        if xgr is None:
            raise EngineError("constrained decoding needs the xgrammar package (pip install "
                              "xgrammar); it is installed with clawray")
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_ids or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_bytes)

    def compile(self, structural_tag: str) -> Any:
        """The compiled grammar of ``structural_tag``; a tag xgrammar refuses is an EngineError
        (HTTP 400) naming the reason."""
        try:
            return self._compiler.compile_structural_tag(structural_tag)
        except Exception as e:  # xgrammar raises several types for bad schemas
            raise EngineError(f"the requested output format cannot be enforced: "
                              f"{_reason(e)}") from None

    def row(self, compiled: Any) -> RowGrammar:
        return RowGrammar(compiled, self.vocab_size, self.stop_ids)
