#!/usr/bin/env bash
# The GPU-marked tests in three pytest processes at once: Triton compiles dominate their time
# and run on the CPU, so splitting the files cuts the wall time on a many-core GPU machine.
# Each part's summary is printed at the end; the exit code is non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-out/gpu}"
mkdir -p "$LOG"
# tests/ mirrors src/: the engine's and VSA's folders apart, the GPU fuzz run (a compile per
# case) and the engine's 1,000-run mutation tests (80 s alone, several times that beside the
# compiles of the other parts) apart, VSA's folder in three (one part ran past 480 s on the
# H200 at ea6e16b), every other folder together.
# The engine's fp32 test compiles kernels of its own (tf32x3 dots, 64-token blocks: 2-20 s a
# kernel, cuda:90 compile check), so it runs apart as well.
E=tests/ops/block_sparse_attn
V=tests/ops/video_sparse_attn
parts=(
  "$E --ignore=$E/test_block_sparse_attn_errors.py --deselect=$E/test_block_sparse_attn.py::test_gpu_fp32_is_accurate"
  "$E/test_block_sparse_attn.py::test_gpu_fp32_is_accurate"
  "tests/ops/block_sparse_attn/test_block_sparse_attn_errors.py"
  "$V/test_vsa_fastvideo_equivalents.py"
  "$V/test_vsa_multi.py $V/test_vsa_text.py $V/test_vsa_memory.py"
  "$V --ignore=$V/test_vsa_fastvideo_equivalents.py --ignore=$V/test_vsa_multi.py --ignore=$V/test_vsa_text.py --ignore=$V/test_vsa_memory.py"
  "tests/fuzz"
  "$(ls -d tests/*/ tests/ops/*/ | grep -v -e '^tests/ops/$' -e __pycache__ \
      -e block_sparse_attn -e video_sparse_attn -e fuzz | tr '\n' ' ')"
)
# ONLY=PATTERN: just the parts whose paths contain PATTERN (e.g. ONLY=video_sparse_attn).
if [ -n "${ONLY:-}" ]; then
  kept=()
  for part in "${parts[@]}"; do [[ $part == *"$ONLY"* ]] && kept+=("$part"); done
  parts=("${kept[@]}")
fi
pids=()
for i in "${!parts[@]}"; do
  # shellcheck disable=SC2086  # the part is a list of files
  python3 -m pytest ${parts[$i]} -m gpu -q -p no:cacheprovider >"$LOG/gpu_tests_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  echo "--- part $i: ${parts[$i]:0:80}"
  grep -E "passed|failed|error" "$LOG/gpu_tests_$i.log" | tail -n 3
  grep -E "^(FAILED|ERROR)" "$LOG/gpu_tests_$i.log" | head -n 20
done
exit $status
