"""The embedded default model: a tiny Qwen3 built from code, cached on disk, deterministic.

clawray must run end to end on a laptop without downloading anything, so it builds its own
default policy model the first time one is needed:

1. **Corpus** (``corpus.py``): a seeded generator of English-like prose, ChatML transcripts,
   JSON tool schemas, tool calls, code and markdown. No data files, no downloads.
2. **Tokenizer**: byte-level BPE trained on that corpus with the ``tokenizers`` library
   (``spec.vocab_size`` ids in all). Special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``,
   ``<|im_end|>`` (eos); added, non-special tokens ``<tool_call>``, ``</tool_call>``,
   ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` (one id each, but they
   decode as text so the tool parser sees them). The ChatML template of ``chat_template.py`` is
   saved with it. The real OpenClaw prompt (~60,000 characters with its 12 tool schemas) comes
   out at about 18k tokens, well inside the 32,768 positions.
3. **Model**: a ``transformers`` ``Qwen3ForCausalLM`` (tied embeddings, ~0.65 M parameters at
   the default spec: 2 layers, hidden 64, 4 query and 2 key/value heads of 32 dims, the smallest
   head vLLM's CPU attention serves), randomly initialised from ``torch.manual_seed(spec.seed)``,
   then a small *copy circuit* is written into its first two layers by hand
   (``seed_copy_circuit`` below): attention that finds the first listed tool's name, so the
   model can copy it.
4. **Imprint**: 400 AdamW steps on short chats (``corpus.imprint_example``), loss on the
   assistant answer only, circuit weights frozen (a whole build takes ~35-40 s on 2 idle CPU
   cores, minutes on a busy one).
   Decoding greedily, the model then (a) answers a plain user message with a short canned
   reply and ``<|im_end|>``, and (b) when tools are given and the last user message contains
   ``CALL_TOOL``, answers ``<tool_call>\n{"name": "<first tool>", "arguments": {}}\n</tool_call>``
   then ``<|im_end|>``. That makes every serving path (text, streaming, tool calls, multi-turn)
   exercisable with a model that loads in milliseconds; RL starts from it. Limits (measured on
   300 fresh imprint-style chats by ``scripts/tiny_model_behaviour.py``): plain replies are right ~99% of the time; CALL_TOOL answers
   are a well-formed single call ~98% of the time but name the first tool only ~55% (1-3
   token names; longer names fail); on the 60,000-character OpenClaw prompts the model answers
   with text, not reliably a call.

Determinism: the corpus comes from ``random.Random(seed)``, BPE training is deterministic for a
given input, and the imprint runs with ``torch.manual_seed`` and a fixed thread count, so two
builds of one spec give byte-identical weights and tokenizer files.

Caching: the folder is ``cache_dir / f"tiny-qwen3-{spec.digest()}"``. A build runs in a
temporary folder next to it and is renamed into place when complete, under a file lock, so
concurrent builders in several processes are safe and a crashed build leaves nothing half
written behind. The digest covers the spec and ``RECIPE_VERSION``: bump it when the corpus,
template or training code changes in a way that changes the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from clawray.files import build_folder_once
from clawray.models.chat_template import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START
from clawray.models.corpus import generate_corpus, imprint_example

logger = logging.getLogger(__name__)

RECIPE_VERSION = "4"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<think>", "</think>")
BUILD_INFO = "clawray_build.json"


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the embedded model; two equal specs build identical folders."""

    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention refuses 16
    intermediate_size: int = 192
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    corpus_docs: int = 10_000
    imprint_steps: int = 400
    imprint_batch_size: int = 16
    imprint_lr: float = 3e-3
    imprint_examples: int = 4096
    threads: int = 2

    def digest(self) -> str:
        """Stable short hash of the spec and the build recipe (names the cache folder)."""
        blob = json.dumps({"spec": dataclasses.asdict(self), "recipe": RECIPE_VERSION,
                           "template": CHAT_TEMPLATE}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$CLAWRAY_CACHE_DIR`` or ``~/.cache/clawray/models``."""
    env = os.environ.get("CLAWRAY_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clawray" / "models"


def build_embedded_default(cache_dir: Path | None = None, spec: TinyModelSpec = TinyModelSpec(),
                           progress: bool = False) -> Path:
    """Return the folder of the embedded model for ``spec``, building it once if missing."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_folder_once(cache_dir / f"tiny-qwen3-{spec.digest()}",
                             lambda tmp: _build(tmp, spec, _Progress(progress)), BUILD_INFO)


class _Progress:
    """Build log lines, each shown once: on the module logger, or with ``progress`` on stderr
    when logging would not show it (the CLI configures logging at INFO: printing as well gave
    every line twice)."""

    def __init__(self, echo: bool) -> None:
        self.echo, self.t0 = echo, time.monotonic()

    def __call__(self, msg: str) -> None:
        line = f"[clawray tiny model {time.monotonic() - self.t0:5.1f}s] {msg}"
        shown = logger.isEnabledFor(logging.INFO) and logger.hasHandlers()
        if self.echo and not shown:
            print(line, file=sys.stderr, flush=True)
        else:
            logger.info(line)


def _build(out: Path, spec: TinyModelSpec, say: _Progress) -> None:
    import torch

    say(f"building the embedded model (spec {spec.digest()}) in {out.parent}")
    tokenizer = train_tokenizer(spec, say)
    tokenizer.save_pretrained(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        model = init_model(spec, tokenizer)
        say(f"model: Qwen3, {sum(p.numel() for p in model.parameters()):,} parameters")
        frozen = seed_copy_circuit(model, tokenizer, spec)
        say("seeded the tool-name copy circuit" if frozen else
            "copy circuit not seeded (spec or tokenizer does not fit it)")
        loss = imprint(model, tokenizer, spec, say, frozen)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    info = {"spec": dataclasses.asdict(spec), "digest": spec.digest(), "recipe": RECIPE_VERSION,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "imprint_final_loss": round(loss, 6)}
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    say(f"done: {out.parent / f'tiny-qwen3-{spec.digest()}'}")


def train_tokenizer(spec: TinyModelSpec, say: _Progress | None = None) -> Any:
    """Train the byte-level BPE on the generated corpus; returns a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    say = say or _Progress(False)
    say(f"training byte-level BPE tokenizer (vocab {spec.vocab_size}) on "
        f"{spec.corpus_docs} generated documents")
    # Markup tokens are whole ids; keep them out of the merges by splitting them off the text.
    markup = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS))

    def pieces() -> Iterator[str]:
        for doc in generate_corpus(spec.seed, spec.corpus_docs):
            yield from (p for p in markup.split(doc) if p)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(ADDED_TOKENS), min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(pieces(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids > vocab {spec.vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   model_max_length=spec.max_position_embeddings)
    fast.chat_template = CHAT_TEMPLATE
    say(f"tokenizer: {tok.get_vocab_size()} ids")
    return fast


def init_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """A randomly initialised Qwen3ForCausalLM for ``spec`` (seeded)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    config = Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos[0], pad_token_id=eos[1],
        attn_implementation="sdpa", dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1],
                                               bos_token_id=None)
    return model


def _imprint_batches(tokenizer: Any, spec: TinyModelSpec) -> list[tuple[list[int], int]]:
    """Tokenized imprint chats: ``(prompt ids + answer ids, answer start)``."""
    rng = random.Random(spec.seed + 1)
    end_id = tokenizer.convert_tokens_to_ids(IM_END)
    prefix = len(tokenizer('{"name": "', add_special_tokens=False)["input_ids"])
    out: list[tuple[list[int], int]] = []
    while len(out) < spec.imprint_examples:
        messages, tools, answer = imprint_example(rng)
        if tools and len(tokenizer(f'{{"name": "{tools[0]["function"]["name"]}"',
                                   add_special_tokens=False)["input_ids"]) - prefix > 4:
            continue  # names over 3 tokens are beyond the copy circuit (seed_copy_circuit)
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                               tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end_id]
        out.append((p_ids + a_ids, len(p_ids)))
    return out


def imprint(model: Any, tokenizer: Any, spec: TinyModelSpec, say: _Progress | None = None,
            frozen: dict[Any, Any] | None = None) -> float:
    """Train the answer habits into ``model`` in place; returns the last step's loss.

    ``frozen`` maps parameters to 0/1 masks of the entries that must not change (the seeded
    circuit); Adam leaves an entry whose gradient is always zero untouched."""
    import torch
    import torch.nn.functional as F

    say = say or _Progress(False)
    data = _imprint_batches(tokenizer, spec)
    say(f"imprint: {len(data)} generated chats, {spec.imprint_steps} AdamW steps")
    torch.manual_seed(spec.seed)
    order = random.Random(spec.seed + 2)
    # Batches of similar length waste little on padding: sort, cut, then draw whole batches.
    data.sort(key=lambda item: len(item[0]))
    size = spec.imprint_batch_size
    batches = [data[i:i + size] for i in range(0, len(data) - size + 1, size)]
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=spec.imprint_lr, weight_decay=0.0,
                            betas=(0.9, 0.98))
    warmup = max(1, spec.imprint_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * max(
        0.05, 1 - max(0, s - warmup) / max(1, spec.imprint_steps - warmup)))
    model.train()
    loss_value = float("nan")
    for step in range(spec.imprint_steps):
        batch = order.choice(batches)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        target = torch.zeros((len(batch), width), dtype=torch.bool)
        for row, (seq, start) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            target[row, start: len(seq)] = True
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # Logits only where they are needed: the position before each answer token.
        pred_pos = target[:, 1:]
        logits = model.lm_head(hidden[:, :-1][pred_pos])
        loss = F.cross_entropy(logits, ids[:, 1:][pred_pos])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for param, keep in (frozen or {}).items():
            if param.grad is not None:
                param.grad.mul_(keep)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if step % 50 == 0 or step == spec.imprint_steps - 1:
            say(f"imprint step {step + 1}/{spec.imprint_steps} loss {loss_value:.4f}")
    model.eval()
    return loss_value


# --- the seeded copy circuit ---------------------------------------------------------------------
# Copying a tool name from the prompt needs attention that finds it; a 2-layer model with such
# small heads does not discover that in a few hundred steps (it learns the format and memorizes
# names instead). So the weights that find the name are set by hand and frozen; the imprint trains
# the rest. Residual dims 0..10 are reserved: 0 a constant, 1-3 flags set in the embeddings of the
# tokens ``name``, `` {"`` and `` "``, 4-10 features written by layer 0.
# Layer 0: four purely positional heads (query and key read only the constant dim; RoPE phases
# make head h attend exactly ``2 + h`` tokens back) copy those flags forward: N_d = "``name`` is d
# tokens back", B_d = "`` {"`` is d back", Q3 = "`` "`` is 3 back". In the tools JSON
# ``{"type": "function", "function": {"name": "get_weather"`` the first name token has N3 and
# B4, the second N4 and B5, the third N5 and Q3. In the answer ``{"name": "`` the position
# before the k-th name token has N(k+1). Layer 1, head 0 (key/value head 0): queries N2/N3/N4
# match those key pairs (each feature of a pair in its own head dim, so both must be present),
# in the slowest RoPE dims so distance does not matter, plus a constant term whose RoPE phase
# prefers older keys (the first listed tool, within ~500 tokens). Its value/output start as a
# random rank-16 orthogonal copy of the token embedding and stay trainable. Layer 0 is left
# with positional attention only; key/value head 1 of layer 1 stays free for content attention
# (it is what notices CALL_TOOL). Names longer than three tokens, rare-token names and prompts
# far longer than the imprint's are beyond this circuit.
# Head size: the construction is written for 16-dim heads (``_BASE_HD``) and placed into any
# even head_dim >= 16 (the default is 32: vLLM's CPU attention refuses 16) by ``_rope_dim``:
# RoPE pair i of a 16-dim head (dims i and i + 8, frequency rope_theta ** (-2i/16)) becomes the
# pair of the same frequency in the wider head (dims 2i and 2i + 16 at 32; the nearest frequency
# when head_dim is not a multiple of 16). The QK-norm gains shrink by (16/head_dim) ** 0.25:
# RMS-normalising over head_dim dims and the 1/sqrt(head_dim) score scale together grow the
# score of a fixed set of seeded dims by sqrt(head_dim/16), so every seeded score, hence every
# seeded attention pattern, is the one of the 16-dim construction. The copy stays rank 16 (the
# value dims 16+ of head 0 start at zero): a rank-32 copy at 32 writes twice the energy into
# every position's residual and cost the greeting/other reply choice ~10 points (88% vs 99%
# right on 197 fresh plain chats). At head_dim 16 all of this is the identity (the weights of
# recipe 3).

_N, _B, _Q3, _RESERVED = {2: 4, 3: 5, 4: 6, 5: 7}, {4: 8, 5: 9}, 10, 11
_BASE_HD = 16


def _rope_dim(dim: int, hd: int) -> int:
    """Head dim ``dim`` of the 16-dim construction, placed in a head of ``hd`` dims."""
    half, i = _BASE_HD // 2, dim % (_BASE_HD // 2)
    pair = (2 * i * hd + _BASE_HD) // (2 * _BASE_HD)  # round(i * hd / 16): same frequency
    return pair + (hd // 2 if dim >= half else 0)


def seed_copy_circuit(model: Any, tokenizer: Any, spec: TinyModelSpec) -> dict[Any, Any] | None:
    """Write the copy circuit into ``model`` in place; returns the freeze masks (1 = trainable),
    or None if the spec (4+ heads, 2+ key/value heads, even head_dim >= 16, width) or the
    tokenizer (single-token ``name``, `` {"``, `` "``) does not fit the construction."""
    import torch

    flag_ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("name", ' {"', ' "')]
    cfg, hd, r = model.config, spec.head_dim, _RESERVED
    if (any(len(ids) != 1 for ids in flag_ids) or hd < _BASE_HD or hd % 2
            or cfg.num_hidden_layers < 2 or cfg.num_attention_heads < 4
            or cfg.num_key_value_heads < 2 or cfg.hidden_size < r + _BASE_HD):
        return None
    theta = [spec.rope_theta ** (-2 * i / hd) for i in range(hd // 2)]
    gain = (_BASE_HD / hd) ** 0.25  # keeps the seeded scores those of a 16-dim head
    dim = [_rope_dim(d, hd) for d in range(_BASE_HD)]  # 16-dim construction -> this head
    gen = torch.Generator().manual_seed(spec.seed + 7)
    emb, a0, a1 = model.model.embed_tokens.weight, model.model.layers[0].self_attn, \
        model.model.layers[1].self_attn
    keep: dict[Any, Any] = {}

    def freeze(param: Any) -> Any:
        return keep.setdefault(param, torch.ones_like(param))

    with torch.no_grad():
        emb[:, :r] = 0
        emb[:, 0] = 0.02
        for flag, ids in enumerate(flag_ids, start=1):
            emb[ids[0], flag] = 0.1
        freeze(emb)[:, :r] = 0
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[:r] = 0
            layer.self_attn.o_proj.weight[:r] = 0
            freeze(layer.mlp.down_proj.weight)[:r] = 0
            freeze(layer.input_layernorm.weight)[:r] = 0
        # Layer 0: positional flag copiers; value rows 0-2 carry the flags, rows 3+ stay free.
        for w in (a0.q_proj.weight, a0.k_proj.weight):
            w.zero_()
            freeze(w)[...] = 0
        a0.v_proj.weight[:, :r] = 0
        a0.o_proj.weight[:r] = 0
        freeze(a0.o_proj.weight)[:r] = 0
        for kv in range(cfg.num_key_value_heads):
            for i in range(4):
                a0.k_proj.weight[kv * hd + dim[i], 0] = 1.0
            a0.v_proj.weight[kv * hd: kv * hd + 3] = 0
            for row in range(3):
                a0.v_proj.weight[kv * hd + row, 1 + row] = 1.0
            freeze(a0.v_proj.weight)[kv * hd: kv * hd + 3] = 0
        for h in range(4):
            d = 2 + h
            for i in range(4):
                a0.q_proj.weight[h * hd + dim[i], 0] = math.cos(d * theta[dim[i]])
                a0.q_proj.weight[h * hd + dim[i + 8], 0] = -math.sin(d * theta[dim[i]])
            a0.o_proj.weight[:, h * hd: h * hd + 3] = 0
            a0.o_proj.weight[_N[d], h * hd] = 0.01
            if d in _B:
                a0.o_proj.weight[_B[d], h * hd + 1] = 0.01
            if d == 3:
                a0.o_proj.weight[_Q3, h * hd + 2] = 0.01
            freeze(a0.o_proj.weight)[:, h * hd: h * hd + 3] = 0
        # Layer 1: (query feature, key feature, head dim) matches.
        pairs = [(_N[2], _N[3], 7), (_N[2], _B[4], 15), (_N[3], _N[4], 6), (_N[3], _B[5], 14),
                 (_N[4], _N[5], 5), (_N[4], _Q3, 12)]
        ortho, _ = torch.linalg.qr(torch.randn(cfg.hidden_size - r, cfg.hidden_size - r,
                                               generator=gen))
        for w in (a1.q_proj.weight, a1.k_proj.weight, a1.v_proj.weight):
            w[:hd] = 0  # query head 0 and key/value head 0
        for q_feat, k_feat, d in pairs:
            a1.q_proj.weight[dim[d], q_feat] = 1.0
            a1.k_proj.weight[dim[d], k_feat] = 1.0
        a1.q_proj.weight[dim[3], 0] = -1.0  # RoPE phase pi on the constant: older keys first
        a1.k_proj.weight[dim[3], 0] = 1.0
        a1.v_proj.weight[:_BASE_HD, r:] = ortho[:_BASE_HD]
        a1.o_proj.weight[:, :hd] = 0
        a1.o_proj.weight[r:, :_BASE_HD] = 1.5 * ortho[:_BASE_HD].T  # the copy's strength
        freeze(a1.q_proj.weight)[:hd] = 0
        freeze(a1.k_proj.weight)[:hd] = 0
        freeze(a1.o_proj.weight)[:r] = 0
        # Sharp softmax on the seeded dims (QK-norm would otherwise cap the scores).
        for attn, dims, sharp in ((a0, [0, 1, 2, 3, 8, 9, 10, 11], 4.2),
                                  (a1, [3, 5, 6, 7, 12, 14, 15], 4.0)):
            for norm in (attn.q_norm.weight, attn.k_norm.weight):
                norm.fill_(1.0)
                norm[[dim[d] for d in dims]] = sharp * gain
                freeze(norm)[...] = 0
    return keep
