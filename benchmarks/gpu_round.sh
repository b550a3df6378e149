#!/usr/bin/env bash
# One round of GPU checks and benchmarks on an H200, each step under its own time limit:
#   bash benchmarks/gpu_round.sh tests|short-walk-tests|demo|profile|profile-train|profile-train-compiled|profile-train-graphs|engine|masked|full-first|key-tails|natural-boxes|bwd-overlap|overlap-tests|grad-rows|grad-rows-tests|out-rows|out-rows-tests|vsa|vsa480|psa|sta|e2e|e2e-compiled|e2e-14b-compiled|e2e-hunyuan15|e2e-wan22-5b|coarse|eviction|parallel [...]
#   e2e for the other diffusers families: e2e-hunyuanvideo|e2e-ltx|e2e-ltx2|e2e-cosmos|
#   e2e-kandinsky5|e2e-skyreels-v2|e2e-wan-vace|e2e-chronoedit|e2e-wan-animate, compiled:
#   e2e-skyreels-v2-compiled|e2e-wan-vace-compiled (JSON under $OUT, named as in
#   benchmarks/results/), and e2e-<model>-compiled for any of them (e2e_<model>_compiled_h200.json);
#   e2e-dry: each of those models at full width, 1 block, one dense step; e2e-dry-all: the
#   same with all blocks (does the whole model fit?), JSON under $OUT;
#   e2e-train|e2e-train-14b: the training step (fwd+bwd, gradient checkpointing) of Wan 2.1
#   1.3B 480p / 14B 720p (4 blocks), dense vs VSA 0.875/0.9 with gate (e2e_train_*_h200.json);
#   e2e-train-compiled: the 1.3B step compiled (compile_for_training); e2e-train-compiled-out-rows:
#   the same with configs.override(out_rows=True) (benchmarks/tuning/bench_with_override.py);
#   vsa-out-rows: bench vsa under the same override; e2e-train-compiled-gate-tensor: the VSA
#   rows of that step with the gate handed to the op as a tensor (bench_gate_tensor.py), the
#   A/B of GateProjection; e2e-train-compiled-regather: the same VSA rows with
#   configs.override(regather=True); gate-projection-tests: both's GPU tests, the compiled
#   training test, VSA's out-rows test and the Gluon backward's; persistent-fwd: the Gluon
#   forward at 128x128 with and without GluonOptions.PERSISTENT (try_gluon_fwd.py, checked
#   then timed; try_gluon_fwd.json), and its GPU tests; engine-one-block: the engine's table
#   at 128x128 (ours, cuDNN, Flex) with it off (bench_with_override.py), the A/B of the
#   default; vsa480-persistent: bench vsa at Wan 480p with PERSISTENT_TILES on (the 64-row
#   persistent kernel), and vsa-tests-persistent VSA's GPU tests with it; one-pass-bwd: the
#   one-pass backward's GPU tests (dQ by atomics, bwd_sm90.dkdvdq_gluon), then its A/B
#   against the two Gluon kernels (try_gluon_bwd.py --one-pass, try_one_pass_bwd.json);
#   engine-one-pass: the engine's 128x128 table (ours, cuDNN, Flex) with the backward in one
#   pass, ordered then unordered (configs.override(one_pass=...), bench_with_override.py);
#   lists-tests: the persistent walks' GPU tests (a CUDA graph captures the banded walk);
#   one-pass-tma: the one-pass backward's GPU tests (atomics, TMA reductions, ordered), then the
#   one-pass A/B (try_one_pass_bwd.json); engine-one-pass-tma: the engine's table with it,
#   unordered then ordered (one_pass=tma, ordered_tma);
#   fixed-point: the one pass with dQ in int32 fixed point (the deterministic default at
#   128x128): its CPU-and-GPU tests, the Gluon backward's GPU tests, then the one-pass A/B
#   (try_gluon_bwd.py --one-pass: fixed, tma, atomics, ordered against the two kernels);
#   engine-rounds: #19's bars (1/8, 128x128: ours, ours-nondet, cuDNN, Flex; ENGINE_PROVIDERS picks
#   others, e.g. ours-fixed) over ROUNDS (5)
#   rounds in turn, medians and every round's figures (block_sparse_rounds_h200.json);
#   vsa480-rounds: #19's 480p VSA bars (0.875; ours, ours-natural, cuDNN) over ROUNDS (5)
#   rounds in turn (vsa480_rounds_h200.json);
#   tile-pool: VSA natural order with q, k, v tiled in the coarse stage's pooling read against
#   a tiling pass before the pooling (try_bwd_overlap.py --study tile-pool; GRAD_ROWS_CASES
#   picks the cases, e.g. vsa480); tile-pool-tests: its GPU tests, VSA's, the tile kernels' and
#   the compiled training step's;
#   preprocess-warps: the natural-order backward's preprocess on 4, 8 and 16 warps
#   (try_bwd_overlap.py --study preprocess-warps; GRAD_ROWS_CASES as above);
#   coarse-softmax: VSA 480p natural order with the coarse backward's softmax gradient in one
#   launch against PyTorch's ops (try_bwd_overlap.py --study coarse-softmax);
#   transpose-kernels: the transposed lists' kernels (lists.transpose_lists): their GPU tests,
#   their time alone against the sort (try_transpose_lists.py) and VSA 480p's backward with each
#   (try_bwd_overlap.py --study transpose-kernels);
#   compile-training-order: the compiled-training GPU test after the host-reads one, with
#   tile_pool on and off, then alone (it lost a parameter's gradient once in that order);
#   engine-nondet: the engine's 128x128 table with deterministic=False beside the default
#   (ours-nondet: the one-pass backward); nondet-tests: its GPU tests and the one pass's;
#   schedule-steps: a scheduled VSA arm's step time at its target against the unscheduled
#   arm's, and with dynamo's floats specialised (try_schedule_steps.py); step-times: the dense
#   and the scheduled VSA arm's step times on one machine, twice in turn (the same script);
#   persistent-bwd: the persistent dK/dV and dQ kernels' GPU tests, then their A/B against one
#   block a program (try_gluon_bwd.py --persistent, try_persistent_bwd.json);
#   engine-persistent-bwd: the engine's 128x128 table with both (configs.override(
#   persistent_dkdv=True, persistent_dq=True));
#   clocks: the engine's 1/8 fwd+bwd over do_bench windows of 10 ms to 3 s with the SM clock and
#   power beside them (profile_clocks.py, clocks.json);
#   host-reads: which lines of a compiled train_vsa step (dense, VSA 0.875, full size) read
#   tensors back to the host or sync (find_host_reads.py), and its GPU test (tiny model);
#   profile-nondet: the engine's 1/8 fwd+bwd at S=32k under torch.profiler, deterministic and
#   not (the one pass's kernels: accumulator zeroing, one pass, conversion), then Nsight Compute
#   on the one-pass kernel where ncu is installed and allowed (the adds' limit: L2 or waits?);
#   train-vsa-<arm>-compiled (arm: dense, vsa0.875, vsa0.9, vsa0.875-warmup, finetune-dense,
#   finetune-vsa):
#   train_vsa's arms with compiled blocks, each in its own call, dense first; out/ is kept
#   on a warm machine, so each plot holds the arms before it; TRAIN_SEED=N: another seed
#   (init and data order), into out/train_vsa_compiled_seedN; longer arms: TRAIN_STEPS=N (into
#   out/train_vsa_compiled_stepsN[_seedM]), TRAIN_DECAY=N (the cosine's floor from step N on),
#   TRAIN_MINUTES (the call's training budget, 7.5), TRAIN_RESUME=1 (continue the arm's
#   checkpoint: the next call of an arm that stopped at its budget, on the same warm machine),
#   TRAIN_EVAL_EVERY=N (steps between evals, 50; evals draw no training randomness, and at
#   100 a 1,200-step dense arm should fit one call on an H100: ~495 s, estimated)
#   (default: tests demo; parallel needs 2 GPUs)
# OUT is this script's log folder: every step logs under $OUT (./out/gpu when OUT is unset), so
# a step that hits its time limit still leaves its log behind. Where the tree was copied to the
# GPU machine without its .git, pass the commit being measured in VIDSPARSE_GIT_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # src first, then what PYTHONPATH held (e.g. /tmp/site)

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "=== $name exit $? ; last lines:"
  tail -n 15 "$OUT/$name.log"
}

ENGINE_1_8="benchmarks/profile/profile_block_sparse.py --seq 32768 --density 0.125 --block 128x128"
PROFILE_NONDET="python3 $ENGINE_1_8 && python3 $ENGINE_1_8 --nondet && if command -v ncu >/dev/null; \
  then ncu --clock-control none --kernel-name regex:dkdvdq_gluon_kernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --metrics lts__t_sectors_op_red.sum,lts__t_requests_op_red.sum,lts__t_sectors.sum,l1tex__m_xbar2l1tex_read_bytes.sum python3 $ENGINE_1_8 --nondet; else echo 'ncu: not on this machine'; fi"
E2E_NEW="hunyuanvideo ltx ltx2 cosmos kandinsky5 skyreels-v2 wan-vace chronoedit wan-animate"
E2E_SPARSE=(--methods dense,vsa,psa --psa-sparsities 0.6,0.75 --no-vsa-gate)
E2E_DENSE_ONCE=(--methods dense --warmup 0 --reps 1 --share-reps 0)

[ $# -eq 0 ] && set -- tests demo
for what in "$@"; do
  case $what in
    tests) step gpu_tests 540 bash benchmarks/gpu_tests_parallel.sh ;;
    short-walk-tests) step short_walk_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/ops/block_sparse_attn/test_gluon_fwd.py tests/ops/video_sparse_attn/test_vsa_fine.py \
      tests/ops/block_sparse_attn/test_block_sparse_attn.py::test_gpu_short_walks_match_reference_and_all_rows \
      tests/ops/video_sparse_attn/test_vsa.py::test_vsa_gpu_dkdv_short_query_walks_match_all_rows ;;
    profile) step profile 150 python3 benchmarks/profile/profile_methods.py ;;
    profile-train) step profile_train 200 python3 benchmarks/profile/profile_train_step.py ;;
    profile-train-compiled) step profile_train_compiled 300 python3 \
      benchmarks/profile/profile_train_step.py --compile blocks --steps 10 ;;
    profile-train-graphs) step profile_train_graphs 300 python3 \
      benchmarks/profile/profile_train_step.py --compile blocks-graphs --steps 10 ;;
    demo) step demo 120 python3 -m vidsparse demo --out "$OUT/demo" ;;
    engine) step engine 540 python3 -m vidsparse.bench block_sparse --shapes default \
      --providers ours,ours-nondet,cudnn,flash,flex,flex64 --block-sizes 128x128,128x64,64x64 \
      --out "$OUT/block_sparse_h200.json" ;;
    engine-rounds) step engine_rounds 400 python3 -m vidsparse.bench block_sparse \
      --densities 0.125 --block-sizes 128x128 --providers ${ENGINE_PROVIDERS:-ours,ours-nondet,cudnn,flex} \
      --rounds "${ROUNDS:-5}" --no-plot --out "$OUT/block_sparse_rounds_h200.json" ;;
    engine-nondet) step engine_nondet 300 python3 -m vidsparse.bench block_sparse \
      --shapes default --providers ours,ours-nondet,cudnn,flex --block-sizes 128x128 \
      --out "$OUT/block_sparse_nondet_h200.json" ;;
    nondet-tests) step nondet_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/ops/block_sparse_attn/test_deterministic.py tests/ops/block_sparse_attn/test_gluon_bwd.py \
      -k "deterministic or one_pass" ;;
    schedule-steps) step try_schedule_steps 420 env OUT="$OUT" python3 \
      benchmarks/tuning/try_schedule_steps.py ;;
    step-times) step try_step_times 560 env OUT="$OUT" python3 \
      benchmarks/tuning/try_schedule_steps.py --variants dense,scheduled --repeats 2 \
      --json try_step_times.json ;;
    masked) step tune_masked 300 python3 benchmarks/tuning/tune_block_sparse.py --masked \
      --out "$OUT/tune_masked.json" ;;
    full-first) step tune_full_first 200 python3 benchmarks/tuning/tune_block_sparse.py --full-first \
      --out "$OUT/tune_full_first.json" ;;
    persistent-fwd) step try_persistent_fwd 300 env OUT="$OUT" python3 \
      benchmarks/tuning/try_gluon_fwd.py --variants reg_s2_pp,reg_s2_pp_persistent
      step persistent_fwd_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_gluon_fwd.py -k persistent ;;
    engine-one-block) step engine_one_block 400 python3 benchmarks/tuning/bench_with_override.py \
      gluon.PERSISTENT=false -- block_sparse --shapes default --providers ours,cudnn,flex \
      --block-sizes 128x128 --out "$OUT/block_sparse_one_block_h200.json" ;;
    vsa480-persistent) step vsa480_persistent 200 python3 benchmarks/tuning/bench_with_override.py \
      gluon.PERSISTENT_TILES=true -- vsa --shapes wan1.3b-480p --sparsities 0.875 \
      --out "$OUT/vsa480_persistent_h200.json" ;;
    vsa-tests-persistent) step vsa_tests_persistent 500 env VIDSPARSE_TEST_GLUON=PERSISTENT_TILES=1 \
      ONLY=video_sparse_attn OUT="$OUT/persistent_tiles" bash benchmarks/gpu_tests_parallel.sh ;;
    one-pass-bwd) step one_pass_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_gluon_bwd.py -k one_pass
      step try_one_pass_bwd 300 env OUT="$OUT" python3 benchmarks/tuning/try_gluon_bwd.py \
        --one-pass --cases engine ;;
    lists-tests) step lists_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_lists.py ;;
    one-pass-tma) step one_pass_tma_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_gluon_bwd.py -k one_pass
      step try_one_pass_bwd 300 env OUT="$OUT" python3 benchmarks/tuning/try_gluon_bwd.py \
        --one-pass --cases engine ;;
    fixed-point) step fixed_point_tests 360 python3 -m pytest -q -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_fixed_point_dq.py tests/ops/block_sparse_attn/test_gluon_bwd.py \
        tests/ops/block_sparse_attn/test_deterministic.py
      step try_one_pass_bwd 300 env OUT="$OUT" python3 benchmarks/tuning/try_gluon_bwd.py \
        --one-pass --cases engine ;;
    engine-one-pass-tma) for mode in tma ordered_tma; do
        step "engine_one_pass_$mode" 200 python3 benchmarks/tuning/bench_with_override.py \
          one_pass=$mode -- block_sparse --shapes default --providers ours,cudnn,flex \
          --block-sizes 128x128 --out "$OUT/block_sparse_one_pass_${mode}_h200.json"
      done ;;
    engine-one-pass) for mode in ordered unordered; do
        step "engine_one_pass_$mode" 200 python3 benchmarks/tuning/bench_with_override.py \
          one_pass=$mode -- block_sparse --shapes default --providers ours,cudnn,flex \
          --block-sizes 128x128 --out "$OUT/block_sparse_one_pass_${mode}_h200.json"
      done ;;
    persistent-bwd) step persistent_bwd_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_gluon_bwd.py -k persistent
      step try_persistent_bwd 300 env OUT="$OUT" python3 benchmarks/tuning/try_gluon_bwd.py \
        --persistent --cases engine ;;
    engine-persistent-bwd) step engine_persistent_bwd 200 python3 \
      benchmarks/tuning/bench_with_override.py persistent_dkdv=true persistent_dq=true -- \
      block_sparse \
      --shapes default --providers ours,cudnn,flex --block-sizes 128x128 \
      --out "$OUT/block_sparse_persistent_bwd_h200.json" ;;
    host-reads) step host_reads 360 bash -c "python3 benchmarks/profile/find_host_reads.py \
      --compile blocks && python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/bench/test_profile_host_reads.py" ;;
    profile-nondet) step profile_nondet 300 bash -c "$PROFILE_NONDET" ;;
    clocks) step profile_clocks 200 python3 benchmarks/profile/profile_clocks.py --out "$OUT" ;;
    key-tails) step try_key_tails 300 env OUT="$OUT" python3 benchmarks/tuning/try_key_tails.py ;;
    bwd-overlap) step try_bwd_overlap 300 env OUT="$OUT" python3 benchmarks/tuning/try_bwd_overlap.py ;;
    overlap-tests) step overlap_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/ops/block_sparse_attn/test_block_sparse_attn.py -k "overlap or fused" ;;
    grad-rows) step try_grad_rows 300 env OUT="$OUT" python3 benchmarks/tuning/try_bwd_overlap.py \
      --study grad-rows ${GRAD_ROWS_CASES:+--cases "$GRAD_ROWS_CASES"} ;;
    out-rows) step try_out_rows 540 env OUT="$OUT" python3 benchmarks/tuning/try_bwd_overlap.py \
      --study out-rows ${GRAD_ROWS_CASES:+--cases "$GRAD_ROWS_CASES"} ;;
    tile-pool) step try_tile_pool 540 env OUT="$OUT" python3 benchmarks/tuning/try_bwd_overlap.py \
      --study tile-pool ${GRAD_ROWS_CASES:+--cases "$GRAD_ROWS_CASES"} ;;
    compile-training-order)  # the compiled-training test after the host-reads one (their order
      # in the GPU suite's last part, where it failed once at 20a1759), with the fused tiling
      # and pooling on, then off, then the compiled-training test alone
      ORDER=(tests/bench/test_profile_host_reads.py tests/integrations/test_diffusers_compile_training.py)
      step order_tile_pool_on 300 python3 -m pytest -q -m gpu -p no:cacheprovider "${ORDER[@]}"
      step order_tile_pool_off 300 python3 benchmarks/tuning/bench_with_override.py tile_pool=false \
        -- pytest -q -m gpu -p no:cacheprovider "${ORDER[@]}"
      step compile_training_alone 200 python3 -m pytest -q -m gpu -p no:cacheprovider "${ORDER[1]}" ;;
    preprocess-warps) step try_preprocess_warps 540 env OUT="$OUT" python3 \
      benchmarks/tuning/try_bwd_overlap.py --study preprocess-warps \
      ${GRAD_ROWS_CASES:+--cases "$GRAD_ROWS_CASES"} ;;
    coarse-softmax) step try_coarse_softmax 300 env OUT="$OUT" python3 \
      benchmarks/tuning/try_bwd_overlap.py --study coarse-softmax --cases vsa480 ;;
    transpose-kernels)
      step transpose_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/block_sparse_attn/test_transpose_lists.py
      step try_transpose_lists 120 env OUT="$OUT" python3 benchmarks/tuning/try_transpose_lists.py
      step try_transpose_kernels 300 env OUT="$OUT" python3 \
        benchmarks/tuning/try_bwd_overlap.py --study transpose-kernels --cases vsa480 ;;
    tile-pool-tests) step tile_pool_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/ops/video_sparse_attn/test_vsa_coarse.py tests/ops/video_sparse_attn/test_vsa.py \
      tests/layout/test_layout_permute.py tests/integrations/test_diffusers_compile_training.py ;;
    out-rows-tests) step out_rows_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/ops/block_sparse_attn/test_output_rows.py tests/ops/video_sparse_attn/test_vsa.py \
      -k "output_stored or natural_order" ;;
    grad-rows-tests) step grad_rows_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/ops/block_sparse_attn/test_block_sparse_attn.py tests/ops/video_sparse_attn/test_vsa.py \
      tests/ops/video_sparse_attn/test_vsa_precision.py tests/ops/video_sparse_attn/test_vsa_memory.py \
      -k "row_maps or overlap or natural or wan_480p or (vsa_gpu and False)" ;;
    natural-boxes) step try_natural_boxes 200 python3 benchmarks/tuning/try_natural_boxes.py \
      --out "$OUT/try_natural_boxes.json" ;;
    vsa480) step vsa480 200 python3 -m vidsparse.bench vsa --shapes wan1.3b-480p \
      --sparsities 0.875 --out "$OUT/vsa480_h200.json" ;;
    vsa) step vsa 540 python3 -m vidsparse.bench vsa --out "$OUT/vsa_h200.json" ;;
    vsa480-rounds) step vsa480_rounds 400 python3 -m vidsparse.bench vsa --shapes wan1.3b-480p \
      --sparsities 0.875 --providers ours,ours-natural,cudnn --rounds "${ROUNDS:-5}" \
      --out "$OUT/vsa480_rounds_h200.json" ;;
    psa) step psa 540 python3 -m vidsparse.bench psa --out "$OUT/psa_h200.json" ;;
    sta) step sta 540 python3 -m vidsparse.bench sta --check --out "$OUT/sta_h200.json" ;;
    e2e) step e2e 200 python3 -m vidsparse.bench e2e --out "$OUT/e2e_h200.json" ;;
    e2e-train) step e2e_train 240 python3 -m vidsparse.bench e2e --train \
      --out "$OUT/e2e_train_h200.json" ;;
    e2e-train-compiled) step e2e_train_compiled 270 python3 -m vidsparse.bench e2e --train \
      --compile blocks --out "$OUT/e2e_train_compiled_h200.json" ;;
    e2e-train-compiled-out-rows) step e2e_train_compiled_out_rows 270 \
      python3 benchmarks/tuning/bench_with_override.py out_rows=true -- e2e --train \
      --compile blocks --out "$OUT/e2e_train_compiled_out_rows_h200.json" ;;
    e2e-train-compiled-gate-tensor) step e2e_train_compiled_gate_tensor 200 \
      python3 benchmarks/tuning/bench_gate_tensor.py -- e2e --train --compile blocks \
      --methods vsa --vsa-sparsities 0.875 --out "$OUT/e2e_train_compiled_gate_tensor_h200.json" ;;
    e2e-train-compiled-regather) step e2e_train_compiled_regather 200 \
      python3 benchmarks/tuning/bench_with_override.py regather=true -- e2e --train \
      --compile blocks --methods vsa --vsa-sparsities 0.875 \
      --out "$OUT/e2e_train_compiled_regather_h200.json" ;;
    gate-projection-tests) step gate_projection_tests 240 python3 -m pytest -q -m gpu \
      -p no:cacheprovider tests/ops/video_sparse_attn/test_gate_projection.py \
      tests/ops/video_sparse_attn/test_vsa.py::test_vsa_gpu_regathered_copies_equal_kept_copies \
      tests/integrations/test_diffusers_compile_training.py \
      tests/ops/video_sparse_attn/test_vsa.py::test_vsa_gpu_output_stored_in_natural_order_equals_untiling \
      tests/ops/block_sparse_attn/test_gluon_bwd.py ;;
    vsa-out-rows) step vsa_out_rows 540 python3 benchmarks/tuning/bench_with_override.py \
      out_rows=true -- vsa --out "$OUT/vsa_out_rows_h200.json" ;;
    train-vsa-*-compiled)  # one arm a call: ~5 minutes each (fine-tunes: after dense, warm)
      arm=${what#train-vsa-}; arm=${arm%-compiled}
      case $arm in
        dense|vsa0.875|vsa0.9|vsa0.875-warmup|finetune-dense|finetune-vsa) ;;
        *) echo "unknown train_vsa arm: $arm" >&2; exit 2 ;;
      esac
      seed=${TRAIN_SEED:-0}; long=${TRAIN_STEPS:+_steps$TRAIN_STEPS}
      dir=out/train_vsa_compiled$long${TRAIN_SEED:+_seed$seed}
      sub=${TRAIN_SEED:+seed$seed/}  # seeds apart under $OUT too: one call may run several
      mkdir -p "$dir" "$OUT/$sub"  # $dir is kept across calls on a warm machine (out/ is ignored)
      step "train_vsa_${arm}_compiled$long${TRAIN_SEED:+_seed$seed}" 580 python3 -m vidsparse.bench train_vsa --arm "$arm" \
        --compile blocks --seed "$seed" --out "$dir" --max-minutes "${TRAIN_MINUTES:-7.5}" \
        ${TRAIN_STEPS:+--steps "$TRAIN_STEPS"} ${TRAIN_DECAY:+--lr-decay-steps "$TRAIN_DECAY"} \
        ${TRAIN_EVAL_EVERY:+--eval-every "$TRAIN_EVAL_EVERY"} ${TRAIN_RESUME:+--resume}
      cp "$dir"/*.json "$dir"/*.png "$OUT/$sub" ;;
    e2e-train-14b) step e2e_train_14b 240 python3 -m vidsparse.bench e2e --train --model wan14b \
      --layers 4 --warmup 1 --reps 3 --share-reps 1 \
      --out "$OUT/e2e_train_wan14b-720p_h200.json" ;;
    e2e-compiled) step e2e_compiled 400 python3 -m vidsparse.bench e2e --compile blocks \
      --out "$OUT/e2e_compiled_h200.json" ;;
    e2e-14b-compiled) step e2e_14b_compiled 220 python3 -m vidsparse.bench e2e --model wan14b \
      --layers 8 --compile blocks --methods dense,vsa --no-vsa-gate \
      --out "$OUT/e2e_wan14b-720p_compiled_h200.json" ;;
    e2e-hunyuan15) step e2e_hunyuan15 220 python3 -m vidsparse.bench e2e --model hunyuan1.5 \
      --methods dense,vsa,psa --psa-sparsities 0.6,0.75 --no-vsa-gate \
      --out "$OUT/e2e_hunyuan1.5-720p_h200.json" ;;
    e2e-wan22-5b) step e2e_wan22_5b 140 python3 -m vidsparse.bench e2e --model wan2.2-5b \
      --methods dense,vsa,psa --psa-sparsities 0.6,0.75 --no-vsa-gate \
      --out "$OUT/e2e_wan2.2-5b-720p_h200.json" ;;
    e2e-hunyuanvideo) step e2e_hunyuanvideo 300 python3 -m vidsparse.bench e2e \
      --model hunyuanvideo "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_hunyuanvideo-720p_h200.json" ;;
    e2e-ltx) step e2e_ltx 180 python3 -m vidsparse.bench e2e --model ltx "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_ltx-1216x704_h200.json" ;;
    e2e-ltx2) step e2e_ltx2 300 python3 -m vidsparse.bench e2e --model ltx2 "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_ltx2-1536x1024_h200.json" ;;
    e2e-cosmos) step e2e_cosmos 300 python3 -m vidsparse.bench e2e --model cosmos \
      "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_cosmos-720p_h200.json" ;;
    e2e-kandinsky5) step e2e_kandinsky5 240 python3 -m vidsparse.bench e2e --model kandinsky5 \
      "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_kandinsky5-768x512_h200.json" ;;
    e2e-skyreels-v2) step e2e_skyreels_v2 300 python3 -m vidsparse.bench e2e --model skyreels-v2 \
      "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_skyreels-v2-720p_h200.json" ;;
    e2e-wan-vace) step e2e_wan_vace 240 python3 -m vidsparse.bench e2e --model wan-vace \
      "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_wan-vace-720p_h200.json" ;;
    e2e-chronoedit) step e2e_chronoedit 240 python3 -m vidsparse.bench e2e --model chronoedit \
      "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_chronoedit-720p_h200.json" ;;
    e2e-wan-animate) step e2e_wan_animate 300 python3 -m vidsparse.bench e2e --model wan-animate \
      "${E2E_SPARSE[@]}" \
      --out "$OUT/e2e_wan-animate-720p_h200.json" ;;
    e2e-skyreels-v2-compiled) step e2e_skyreels_v2_compiled 300 python3 -m vidsparse.bench e2e \
      --model skyreels-v2 --compile blocks --methods dense,vsa --no-vsa-gate \
      --out "$OUT/e2e_skyreels-v2-720p_compiled_h200.json" ;;
    e2e-wan-vace-compiled) step e2e_wan_vace_compiled 300 python3 -m vidsparse.bench e2e \
      --model wan-vace --compile blocks --methods dense,vsa --no-vsa-gate \
      --out "$OUT/e2e_wan-vace-720p_compiled_h200.json" ;;
    e2e-dry) for m in $E2E_NEW; do
        step "e2e_dry_$m" 150 python3 -m vidsparse.bench e2e --model "$m" --layers 1 \
          "${E2E_DENSE_ONCE[@]}" --out "$OUT/e2e_dry_$m.json"
      done ;;
    e2e-dry-all) for m in $E2E_NEW; do
        step "e2e_dry_all_$m" 300 python3 -m vidsparse.bench e2e --model "$m" --layers all \
          "${E2E_DENSE_ONCE[@]}" --out "$OUT/e2e_dry_all_$m.json"
      done ;;
    parallel) step parallel 400 torchrun --nproc-per-node 2 -m vidsparse.bench parallel \
      --providers vsa,comm --modes fwd --head-chunks 1,2,4 --out "$OUT/parallel_h200_2gpu.json" ;;
    eviction) step tune_eviction 300 python3 benchmarks/tuning/tune_eviction.py \
      --out "$OUT/tune_eviction.json" ;;
    coarse) step tune_coarse 250 python3 benchmarks/tuning/tune_vsa_coarse.py --selection --pooled \
      --out "$OUT/tune_coarse_selection.json" ;;
    e2e-*-compiled) m=${what#e2e-}; m=${m%-compiled}  # the other families, compiled blocks
      case " $E2E_NEW " in *" $m "*) ;; *) echo "unknown e2e model: $m" >&2; exit 2 ;; esac
      step "e2e_${m}_compiled" 420 python3 -m vidsparse.bench e2e --model "$m" --compile blocks \
        --methods dense,vsa --no-vsa-gate --out "$OUT/e2e_${m}_compiled_h200.json" ;;
    *) echo "unknown step: $what" >&2; exit 2 ;;
  esac
done
