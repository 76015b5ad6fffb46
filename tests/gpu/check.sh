#!/usr/bin/env bash
# GPU check for one NVIDIA GPU (H100/H200): kernel tests compiled for real on CUDA tensors, the
# model fidelity test on CUDA, then a short benchmark ending in one table. About 3-5 minutes;
# needs no network. Exit status: non-zero if any step failed (every step still runs).
#
# Needs a python with torch (CUDA), triton, transformers, safetensors, numpy and pytest: the
# device image's python3 has them (override with PYTHON=...). From this machine, via the
# device tool (the working tree is copied there; nothing else is needed):
#     run(command="bash tests/gpu/check.sh", timeout_s=540)
# Logs and bench.json land in $OUT (the tool returns them) or /tmp/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
LOG=${OUT:-/tmp/gpu-check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/triton-cache TPLLM_CACHE_DIR=/tmp/tpllm-cache
unset TRITON_INTERPRET TPLLM_KERNELS  # compiled kernels; Triton chosen by device (auto)

status=()
step() {  # step NAME TIMEOUT_S CMD...: run, tee the log, record pass/fail
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  local verdict=ok
  [ "$rc" = 0 ] || verdict="FAIL($rc)"
  status+=("$(printf '%-6s %-9s %4ss' "$name" "$verdict" $((SECONDS - t0)))")
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
step env 60 "$PY" -c "
import torch, triton, transformers, safetensors
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      'transformers', transformers.__version__)
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
step tests 300 "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/test_kernels.py tests/test_engine_triton_kernels.py
step bench 240 "$PY" tests/gpu/bench_gpu.py

echo; echo "=== summary"
printf '%s\n' "${status[@]}"
printf '%s\n' "${status[@]}" | grep -q FAIL && exit 1
exit 0
