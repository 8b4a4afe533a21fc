#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU: build fastmesh with its CUDA sources, run the GPU
# checks and the CUDA tests, and write every log and result file to a folder.
#
#   bash bench/gpu_check.sh [OUT_DIR]          # OUT_DIR defaults to $OUT, else ./gpu_check_out
#   FASTMESH_GPU_CHECK_QUICK=0 bash bench/gpu_check.sh   # the full checks (default: --quick)
#
# Steps (each logged to OUT_DIR/<step>.log, its exit status to OUT_DIR/status.txt):
#   build      pip install --no-build-isolation --no-deps -e . (CUDA sources for the visible GPU's arch;
#              the GPU machine has no package index, so nothing may be fetched)
#   info       fastmesh info --json
#   fp8-cuda   bench/gpu_check_fp8.py --impl cuda   (CUDA C++ quantize kernels: exactness, GB/s vs copy)
#   fp8-triton bench/gpu_check_fp8.py --impl triton (the Triton kernels, the same checks)
#   chunked    bench/gpu_check_chunked_matmul.py    (consumer GEMM: correctness, loopback, speed vs torch.mm)
#   all-reduce bench/gpu_check_matmul_all_reduce.py (matmul_all_reduce and its FP8 form on CUDA tensors, 2 ranks:
#              NCCL with two GPUs, gloo on one; bit-exact against mm + all_reduce, autograd, fp8=; speed)
#   tests      pytest tests/test_chunked_matmul.py tests/test_chunked_gather.py tests/test_fp8_triton.py
#              tests/test_mx.py tests/test_mx_triton.py tests/test_matmul_all_reduce.py tests/test_matmul_all_gather.py
#              tests/test_fused_collectives_fp8.py tests/test_fused_block_scaled.py tests/test_faults.py (their CUDA
#              tests run on a GPU: the block-scaled ops through torch._scaled_mm on SM90, the consumer
#              GEMM's waits, the fused all-gather's loopback path; the multi-rank tests run over NCCL with a GPU per
#              rank, else on gloo; the MX tests run the MX cast's CPU kernel and its Triton kernel, interpreted and
#              compiled for sm_90, on the GPU machine's torch and triton; the last three check the FP8 scaled
#              multiply and the transfers' timeouts on the GPU machine's torch, 2.11)
#   bench      fastmesh bench --device cuda --quick --dtype bfloat16 (table, OUT_DIR/bench/bench.json; the
#              fused ops' quick cases, "ar:" and "mg:" among them; its distributed families need two or
#              more GPUs and say so on one; at most 4 minutes)
# Exit status: 2 without a GPU (nothing else runs), else 0 if every step passed, 1 otherwise.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/gpu_check_out}}"
PY="${PYTHON:-python3}"
QUICK_FLAG=$([ "${FASTMESH_GPU_CHECK_QUICK:-1}" = "1" ] && echo "--quick" || echo "")
mkdir -p "$OUT_DIR"
cd "$ROOT"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh: no CUDA device visible to torch; nothing to check" | tee "$OUT_DIR/status.txt" >&2
  exit 2
fi
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" > "$OUT_DIR/device.txt" 2>&1
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true

failed=0
step() {  # step NAME COMMAND...: run, log, record the status, keep going
  local name="$1"; shift
  local start=$SECONDS
  "$@" > "$OUT_DIR/$name.log" 2>&1
  local status=$?
  echo "$name exit $status ($((SECONDS - start)) s)" | tee -a "$OUT_DIR/status.txt"
  [ $status -eq 0 ] || failed=1
  return $status
}

step build env FASTMESH_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . || { echo "build failed" >&2; exit 1; }
step info "$PY" -m fastmesh info --json
step fp8-cuda "$PY" bench/gpu_check_fp8.py --impl cuda $QUICK_FLAG
step fp8-triton "$PY" bench/gpu_check_fp8.py --impl triton $QUICK_FLAG
step chunked "$PY" bench/gpu_check_chunked_matmul.py $QUICK_FLAG --json "$OUT_DIR/chunked_matmul.json"
step all-reduce "$PY" bench/gpu_check_matmul_all_reduce.py $QUICK_FLAG --json "$OUT_DIR/matmul_all_reduce.json"
step tests "$PY" -m pytest -q -rfEs tests/test_chunked_matmul.py tests/test_chunked_gather.py tests/test_fp8_triton.py \
  tests/test_mx.py tests/test_mx_triton.py tests/test_matmul_all_reduce.py tests/test_matmul_all_gather.py \
  tests/test_fused_collectives_fp8.py tests/test_fused_block_scaled.py tests/test_faults.py
step bench timeout 240 "$PY" -m fastmesh.bench.runner --device cuda --quick --dtype bfloat16 --out "$OUT_DIR/bench"
exit $failed
