#!/usr/bin/env bash
# The GPU check: one command for a person with a CUDA machine, after `make setup` (which
# installs vllm==0.32.0 there). Not run in CI (CI has no GPU); see docs/vllm.md.
#
#   bash bench/gpu_check.sh [MODEL_FOLDER]     # default: the embedded tiny model
#
# 1. the engine conformance suite and the weight-sync tests on vLLM, now on the GPU
#    (generate/stream/seeds/log-probs vs the learner, weights reloaded under streaming load
#    with zero failed requests, LoRA adapters);
# 2. bench/engines.py: clawray over vLLM against `vllm serve` on the same requests (req/s,
#    TTFT at c=1/8/32, the OpenClaw session);
# 3. bench/gpu_nccl.py: the NCCL weight sync (vLLM's weight-transfer engine, created with
#    `inference.weight_transfer: nccl`) from a learner on one GPU into a served replica on
#    another, under streaming load: sync seconds, zero failed requests, log-probs after.
#    Needs 2 GPUs; on one it reports "skipped" (NCCL puts no two ranks on one GPU).
# and writes bench/results/gpu_check.json and gpu_nccl.json. About 10 minutes on one GPU; any
# failure stops it with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-embedded:tiny}
PY=.venv/bin/python
command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: not a CUDA machine" >&2; exit 2; }
nvidia-smi -L
$PY - <<'PYEOF'
import sys, torch
from clawray.inference.vllm import installed_vllm
found = installed_vllm()
if not torch.cuda.is_available() or found is None or found[0] != "vllm":
    sys.exit(f"gpu_check: needs CUDA torch and the CUDA build of vLLM; have cuda="
             f"{torch.cuda.is_available()}, vLLM={found} (run make setup on this machine)")
print("gpu_check:", torch.cuda.get_device_name(0), found)
PYEOF
out=bench/results
mkdir -p "$out"
started=$(date +%s)
$PY -m pytest -q -x tests/cpu/inference tests/cpu/weights/test_weight_sync_on_cpu.py -k vllm \
    --junitxml="$out/gpu_check-tests.xml"
$PY bench/engines.py --setups clawray-vllm,vllm-serve --model "$MODEL" --out "$out/gpu_check.json"
$PY bench/gpu_nccl.py --model "$MODEL" --out "$out/gpu_nccl.json"
echo "gpu_check: passed in $(( $(date +%s) - started )) s; results in $out/gpu_check.json"
