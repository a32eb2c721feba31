"""Load a causal LM, its tokenizer and chat template from a local folder (never from the hub).

``"embedded:tiny"`` (or no name at all) means the embedded default model of ``tiny.py``, built
on first use and cached; ``"bundled:<name>"`` a model an installed registry package ships,
converted once into the same cache (``importer.py``: ``bundled:smollm2``). Anything else must
be a local Hugging Face model folder holding a
``config.json``; clawray never downloads weights implicitly, so a missing folder is an error
that says so instead of a surprise multi-gigabyte download.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from clawray.config import ClawRayConfig
from clawray.models.tiny import TinyModelSpec, build_embedded_default

EMBEDDED_NAME = "embedded:tiny"
BUNDLED_PREFIX = "bundled:"  # a model a registry package ships (clawray/models/importer.py)
_DTYPES = ("float32", "bfloat16", "float16", "auto")


class ModelLoadError(ValueError):
    """A model folder is missing, incomplete, or unusable for chat serving."""


def resolve_model_path(name_or_path: str | Path | None, *, seed: int = 0,
                       cache_dir: Path | None = None) -> Path:
    """Map a model setting to a local folder: ``None``/``"embedded:tiny"`` → the embedded
    default (built once for ``seed``), ``"bundled:<name>"`` → that model's converted folder,
    else an existing folder with a ``config.json``."""
    if name_or_path is None or str(name_or_path) == EMBEDDED_NAME:
        return build_embedded_default(cache_dir, TinyModelSpec(seed=seed))
    if str(name_or_path).startswith("embedded:"):
        raise ModelLoadError(f"unknown embedded model {name_or_path!r}; the only one is "
                             f"{EMBEDDED_NAME!r}")
    if str(name_or_path).startswith(BUNDLED_PREFIX):
        from clawray.models.importer import ModelImportError, bundled_folder

        try:
            return bundled_folder(str(name_or_path)[len(BUNDLED_PREFIX):], cache_dir)
        except ModelImportError as e:
            raise ModelLoadError(str(e)) from None
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model folder {str(path)!r} does not exist. clawray loads models from local folders "
            f"only (no hub downloads): download it first (e.g. `huggingface-cli download "
            f"<repo> --local-dir <folder>`) or use {EMBEDDED_NAME!r}")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is a file, not a model folder")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json: not a Hugging Face "
                             "model folder")
    return path.resolve()


def load_tokenizer(path: str | Path) -> Any:
    """The folder's tokenizer; it must carry a chat template (the ingress renders with it)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer in {str(path)!r} has no chat template; clawray needs "
                             "one to turn chat messages into prompt ids (add chat_template.jinja)")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad id; it is masked anyway
    return tokenizer


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The folder's causal LM in eval mode with sdpa attention, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            Path(path), dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a causal LM from {str(path)!r}: {e}") from e
    return model.to(device).eval()


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the serving side needs to know about a model without loading its weights."""

    path: Path
    name: str  # reported by /v1/models
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # generation_config.json's sampling settings (temperature, top_p, repetition_penalty):
    # the defaults of a request that does not set them, as ``vllm serve`` uses them
    sampling_defaults: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_path(cls, path: str | Path, served_name: str | None = None,
                  tokenizer: Any = None) -> "ModelInfo":
        """Read config.json / generation_config.json (and the tokenizer's eos, if given)."""
        path = Path(path)
        config = _read_json(path / "config.json")
        if config is None:
            raise ModelLoadError(f"model folder {str(path)!r} has no readable config.json")
        config = config.get("text_config", config)  # multimodal wrappers nest the LM config
        max_len = config.get("max_position_embeddings") or config.get("n_positions")
        if not isinstance(max_len, int):
            raise ModelLoadError(f"config.json in {str(path)!r} has no max_position_embeddings")
        generation = _read_json(path / "generation_config.json") or {}
        eos: list[int] = []
        for source in (generation.get("eos_token_id"), config.get("eos_token_id"),
                       getattr(tokenizer, "eos_token_id", None)):
            for token_id in source if isinstance(source, list) else [source]:
                if isinstance(token_id, int) and token_id not in eos:
                    eos.append(token_id)
        if not eos:
            raise ModelLoadError(f"no eos token id in {str(path)!r} (generation_config.json, "
                                 "config.json or tokenizer): generation would never stop")
        return cls(path=path, name=served_name or path.name, max_model_len=max_len,
                   eos_token_ids=tuple(eos), sampling_defaults=sampling_defaults(generation))


# generation_config.json keys a request's sampling defaults come from, and their valid ranges
SAMPLING_DEFAULT_KEYS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0),
                         "repetition_penalty": (0.0, float("inf"))}


def sampling_defaults(generation: dict[str, Any]) -> dict[str, float]:
    """The sampling settings of a generation_config.json (``do_sample: false`` is greedy:
    temperature 0). A value outside its API range is refused, not clamped."""
    out: dict[str, float] = {}
    for key, (low, high) in SAMPLING_DEFAULT_KEYS.items():
        value = generation.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not low <= value <= high or (key != "temperature" and value == 0):
            raise ModelLoadError(f"generation_config.json: {key} = {value!r} is not a valid "
                                 f"default (between {low} and {high})")
        out[key] = float(value)
    if generation.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------- the app's models

EMBEDDED_SERVED_NAME = "clawray-tiny"


def policy_model_info(cfg: ClawRayConfig) -> ModelInfo:
    """The served model's folder (building the embedded default if needed) and name."""
    m = cfg.model_cfg
    path = resolve_model_path(m.path, seed=m.seed)
    from clawray.models.importer import provenance

    default_name = (EMBEDDED_SERVED_NAME if m.path.startswith("embedded:")
                    else (provenance(path) or {}).get("served_name"))
    return ModelInfo.from_path(path, m.served_name or default_name)


def judge_model_path(cfg: ClawRayConfig) -> str | None:
    """The folder the app's JudgeServer loads when it is not the policy model, else None.

    With ``training.mode: rlanything`` and ``rlanything.rm_backend: server`` the JudgeServer is
    the reward model that gets co-trained: ``rlanything.rm_model_path`` wins. Otherwise (and
    when that is unset) ``judge.model_path``. One JudgeServer serves both the RM and, if
    configured, the live PRM judge, so both see the RM's weights.
    """
    r = cfg.rlanything_cfg
    if cfg.training_cfg.mode == "rlanything" and r.rm_backend == "server" and r.rm_model_path:
        return r.rm_model_path
    return cfg.judge_cfg.model_path


def judge_model_info(cfg: ClawRayConfig) -> ModelInfo:
    """The judge model's folder (``judge_model_path``), else the policy model (built if it is
    the embedded default)."""
    path = judge_model_path(cfg) or cfg.model_cfg.path
    return ModelInfo.from_path(resolve_model_path(path, seed=cfg.model_cfg.seed))


def check_teacher_tokenizer(cfg: ClawRayConfig) -> None:
    """OPD and Combine score the policy's sampled token ids under the judge model: with a
    separate judge model (a JudgeServer on ``judge_model_path``), its tokenizer must be the
    policy's, or every teacher log-prob belongs to another token. Raises ``ModelLoadError``."""
    from clawray.config import ConfigError

    kinds = set(cfg.sessions_cfg.sample_kinds) & {"opd", "combine"}
    judge = judge_model_path(cfg)
    teacher_is_server = cfg.judge_cfg.backend == "server" or cfg.judge_cfg.teacher == "server"
    if not kinds or not teacher_is_server or not judge:
        return
    policy = resolve_model_path(cfg.model_cfg.path, seed=cfg.model_cfg.seed)
    judge_dir = resolve_model_path(judge, seed=cfg.model_cfg.seed)
    if policy.resolve() == judge_dir.resolve():
        return
    a, b = load_tokenizer(policy), load_tokenizer(judge_dir)
    if a.get_vocab() != b.get_vocab() or a.all_special_ids != b.all_special_ids:
        raise ConfigError(
            f"sessions.sample_kinds has {sorted(kinds)}, which score the policy's token ids "
            f"under the judge model, but the judge model {str(judge_dir)!r} has another "
            f"tokenizer than the policy {str(policy)!r} (vocabularies differ): use a judge of "
            "the policy's family, or sample_kinds [rl]")
