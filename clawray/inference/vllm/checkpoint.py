"""The safetensors file vLLM reloads weights from, kept whole across partial updates."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from clawray.inference.engine import (
    EngineError,
)


class CheckpointFiles:
    """The weights vLLM reloads from: one safetensors file, rewritten on each update.

    It starts as the model folder's own checkpoint. An update may name a subset of the
    tensors; the others are read from the current file, so the written file is always whole.
    """

    FILE = "model.safetensors"

    def __init__(self, model_folder: Path) -> None:
        self._source = model_folder
        self._folder: Path | None = None
        self._shapes: dict[str, tuple[list[int], str]] | None = None

    def _current_files(self) -> list[Path]:
        folder = self._folder if self._folder is not None else self._source
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise EngineError(f"no *.safetensors weights in {folder}")
        return files

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        """Checkpoint name -> (shape, dtype) of the model's weights."""
        if self._shapes is None:
            from safetensors import safe_open

            shapes = {}
            for file in self._current_files():
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        shapes[name] = (list(sl.get_shape()), sl.get_dtype())
            self._shapes = shapes
        return self._shapes

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise EngineError unless every tensor names a weight of this shape."""
        shapes = self.shapes()
        unknown = [n for n in state_dict if n not in shapes and not _is_tied_head(n, shapes)]
        if unknown:
            raise EngineError(f"unknown weight names for this model: {unknown[:5]}")
        wrong = [f"{n}: {list(t.shape)} != {shapes[n][0]}" for n, t in state_dict.items()
                 if n in shapes and list(t.shape) != shapes[n][0]]
        if wrong:
            raise EngineError(f"weights of the wrong shape: {wrong[:5]}")

    def write(self, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """Write the whole checkpoint with ``state_dict`` applied; return its folder."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        self.check(state_dict)
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            if name in self.shapes():  # a tied lm_head is not in the checkpoint
                # A copy of our own: shared storage (tied weights) cannot be saved as is.
                tensors[name] = tensor.detach().to("cpu").contiguous().clone()
        missing = [n for n in self.shapes() if n not in tensors]
        for file in self._current_files() if missing else []:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if name in missing:
                        tensors[name] = f.get_tensor(name)
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="clawray-vllm-weights-"))
        tmp = self._folder / (self.FILE + ".partial")
        save_file(tensors, str(tmp))
        os.replace(tmp, self._folder / self.FILE)
        return self._folder

    def cleanup(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _is_tied_head(name: str, shapes: Mapping[str, Any]) -> bool:
    return name == "lm_head.weight" and "model.embed_tokens.weight" in shapes
