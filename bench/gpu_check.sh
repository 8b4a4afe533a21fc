#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU: build fastmesh with its CUDA sources, run the GPU
# checks and the CUDA tests, time the kernels, and write every log and result file to a folder.
#
#   bash bench/gpu_check.sh [OUT_DIR]          # OUT_DIR defaults to $OUT, else ./gpu_check_out
#   FASTMESH_GPU_CHECK_QUICK=0 bash bench/gpu_check.sh   # the full checks (default: --quick)
#   FASTMESH_GPU_CHECK_SKIP_BUILD=1 ...        # use the fastmesh already importable (a carried build)
#   FASTMESH_GPU_CHECK_SKIP="chunked bench" ...  # leave these steps out (names below)
#
# It is sized for a short lease (about 8 minutes with --quick): every step has a time limit, the
# correctness steps run side by side (their timings are not reported), and the timing steps run one
# after another on an otherwise idle GPU.
#
# Steps (each logged to OUT_DIR/<step>.log, its exit status and seconds to OUT_DIR/status.txt):
#   build        pip install --no-build-isolation --no-deps -e . (CUDA sources for the visible GPU's arch;
#                the GPU machine has no package index, so nothing may be fetched)
#   info         fastmesh info --json
#   -- side by side --
#   fp8-cuda     bench/gpu_check_fp8.py --impl cuda --skip-bench (CUDA C++ quantize and MX kernels: bit-exact
#                against the references, on poisoned output memory)
#   fp8-triton   bench/gpu_check_fp8.py --impl triton --skip-bench (the Triton kernels, the same checks)
#   all-reduce   bench/gpu_check_matmul_all_reduce.py (matmul_all_reduce and its FP8 form on CUDA tensors,
#                2 ranks: NCCL with two GPUs, gloo on one; bit-exact against mm + all_reduce, autograd, fp8=)
#   graphs       bench/gpu_check_graphs.py (every fused op and cast captured in a CUDA graph and replayed, against
#                eager calls; a cold key captured: the model's plan, said in the log)
#   tests        pytest, one run per file, of the test files with CUDA cases (the block-scaled ops through
#                torch._scaled_mm on SM90, the consumer GEMM's waits, the fused all-gather's loopback path,
#                the MX and FP8 Triton kernels compiled for the GPU, the transfers' timeouts on the GPU
#                machine's torch)
#   -- one after another --
#   fp8-cuda-bw, fp8-triton-bw   the same scripts' bandwidth tables (8192 x 8192, CUDA events around eager calls
#                and CUDA graph replays, vs a copy); the Triton one also sweeps the kernels' work per program
#   chunked      bench/gpu_check_chunked_matmul.py (consumer GEMM: correctness, loopback, speed vs torch.mm)
#   bench        fastmesh bench --device cuda --quick --dtype bfloat16 (OUT_DIR/bench/bench.json; its
#                distributed families need two or more GPUs and say so on one)
# Exit status: 2 without a GPU (nothing else runs), else 0 if every step passed, 1 otherwise.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/gpu_check_out}}"
PY="${PYTHON:-python3}"
QUICK=$([ "${FASTMESH_GPU_CHECK_QUICK:-1}" = "1" ] && echo 1 || echo 0)
QUICK_FLAG=$([ "$QUICK" = "1" ] && echo "--quick" || echo "")
CHECK_SECONDS=$([ "$QUICK" = "1" ] && echo 100 || echo 420)
mkdir -p "$OUT_DIR"
cd "$ROOT"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh: no CUDA device visible to torch; nothing to check" | tee "$OUT_DIR/status.txt" >&2
  exit 2
fi
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" > "$OUT_DIR/device.txt" 2>&1
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log, record the status
  local name="$1" limit="$2"; shift 2
  if [[ " ${FASTMESH_GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    echo "$name skipped (FASTMESH_GPU_CHECK_SKIP)" | tee -a "$OUT_DIR/status.txt"
    return 0
  fi
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local status=$?
  local note=""
  [ $status -eq 124 ] && note=" TIMED OUT after ${limit} s"
  echo "$name exit $status ($((SECONDS - start)) s)$note" | tee -a "$OUT_DIR/status.txt"
  return $status
}

run_test_files() {  # one pytest per file: a crash in one file does not hide the others' results
  local status=0
  for file in "$@"; do
    echo "== $file"
    timeout -k 5 150 "$PY" -m pytest -q -rfEs -p no:cacheprovider "$file" || status=1
  done
  return $status
}
export -f run_test_files
export PY

if [ "${FASTMESH_GPU_CHECK_SKIP_BUILD:-0}" != "1" ]; then
  step build 300 env FASTMESH_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . \
    || { echo "build failed" >&2; exit 1; }
fi
step info 60 "$PY" -m fastmesh info --json

pids=()
step fp8-cuda $((CHECK_SECONDS + 60)) "$PY" bench/gpu_check_fp8.py --impl cuda --skip-bench $QUICK_FLAG \
  --check-seconds "$CHECK_SECONDS" & pids+=($!)
step fp8-triton $((CHECK_SECONDS + 120)) "$PY" bench/gpu_check_fp8.py --impl triton --skip-bench $QUICK_FLAG \
  --check-seconds "$CHECK_SECONDS" & pids+=($!)
step all-reduce 180 "$PY" bench/gpu_check_matmul_all_reduce.py $QUICK_FLAG --json "$OUT_DIR/matmul_all_reduce.json" \
  & pids+=($!)
step graphs 120 "$PY" bench/gpu_check_graphs.py --json "$OUT_DIR/graphs.json" & pids+=($!)
step tests 300 bash -c 'run_test_files "$@"' run_test_files tests/test_chunked_matmul.py tests/test_chunked_gather.py \
  tests/test_fp8_triton.py tests/test_mx.py tests/test_mx_triton.py tests/test_matmul_all_reduce.py \
  tests/test_matmul_all_gather.py \
  tests/test_fused_collectives_fp8.py tests/test_fused_block_scaled.py tests/test_faults.py & pids+=($!)
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done

step fp8-cuda-bw 90 "$PY" bench/gpu_check_fp8.py --impl cuda --skip-check || failed=1
step fp8-triton-bw 240 "$PY" bench/gpu_check_fp8.py --impl triton --skip-check --sweep || failed=1
step chunked 120 "$PY" bench/gpu_check_chunked_matmul.py $QUICK_FLAG --json "$OUT_DIR/chunked_matmul.json" || failed=1
step bench 180 "$PY" -m fastmesh.bench.runner --device cuda --quick --dtype bfloat16 --no-plots \
  --out "$OUT_DIR/bench" || failed=1
exit $failed
