#!/usr/bin/env bash
# The whole GPU job in one call (device time is scarce): CUDA tests on 1 GPU, NCCL torchrun checks on 2,
# then the benchmarks. Everything lands in $OUT (default results/gpu): suite.log + JSON/markdown/PNG.
#   OUT=results/gpu bash scripts/gpu_suite.sh [quick|full] [steps...]
# Steps: info tests tests_slow tests2 dist graph mega peer_check bench_experts bench_layer layer1 eager w4 align (default:
# all; tests = make test-gpu's one-GPU selection, ~5 min; tests_slow = the `slow` one-GPU cases; tests2 = the 2-GPU
# pytest cases; layer1 = bench_layer and profile_step as one process on GPU 0 (the `local` transport);
# eager = the public layer's eager calls (replaying its graphs, and launching with Triton's and the bound launch
# path) vs a hand graph vs torch.compile on one GPU; w4 = the 4-bit experts with their tile sweep and the
# engines' W4A16 kernel; align = the alignment-1 vs 128-aligned pool A/B, with the no-hint pool;
# peer_check = SGLang's and vLLM's fused-MoE kernels, read from the peer files in .whl/ (`make peers`), vs our twin). One device command runs 10 min at
# most, so split them over calls, e.g. `bash scripts/gpu_suite.sh quick info tests dist`.
# Not in the default: auto_table = experts_backend="auto"'s table for this GPU class (moe-ref bench --auto-table, one
# call of its own, < 9 min; $OUT/auto_table.json and .md, to be copied to moe_ref/experts/auto_table.json);
# w4_kernel = the 4-bit kernel's tests on the GPU (its decode of every code pair, every scale byte, the kernel vs its
# twin; tests/gpu/test_quant_cuda.py) and bench_w4a16 with the engines' W4A16 kernel (~6 min); auto_check = auto's and DeepGEMM's GPU tests, then the expert MLPs through the public
# API eagerly and in a CUDA graph (bench_experts --graph) beside DeepGEMM's bare kernels (needs `make deep-gemm-wheels`);
# launch = the bound launch path's tests on the GPU, then the host cost per Triton launch (scripts/bench_launch.py); router = the gate GEMM's GPU tests (cuBLAS, fp32
# output) and scripts/bench_router.py (it against the fp32 torch GEMM it replaced, eager and in a graph); peer:MODEL:ROWS = the expert MLPs at one
# model and row count beside SGLang's and vLLM's kernels at the best config of their own tuners' spaces (the searches
# alone take ~3 min per model; one point per step, up to 590 s, or $PEER_LIMIT s), e.g. peer:kimi-k2:4096 peer:step3:32768, each path timed
# in $PEER_ROUNDS rounds (default 2, alternating order); the point not yet measured whole: Kimi-K2 512; launches = the
# layer's launches, syncs and host time per eager call at decode (bench_eager --profile, launching path and graph);
# epilogue_add = the grouped MLP's add-in-the-epilogue tests (kernel against its twin) on the GPU;
# layout = the FP8 grouped MLP's GPU tests (stacked and interleaved gate/up rows against the twin), then the stacked vs
# interleaved A/B (scripts/ab_grouped_mlp.py --ab layout); fp8_tests = the GPU tests of the FP8 paths around it
# (checkpoint experts, the FP8 layer, auto and DeepGEMM); auto_bench = auto_check's bench alone ($AUTO_ROWS, $AUTO_ROUNDS, $AUTO_LIMIT s,
# $AUTO_PATHS); w4_api = bench_w4a16's API rows alone (bf16, FP8 from the checkpoint, 4-bit; no sweep, no peer);
# schedule = the grouped MLP's schedules A/B (grid, hinted, persistent; scripts/ab_grouped_mlp.py --ab schedule,
# $SCHEDULE_ROWS); w4_tests = the 4-bit kernel's GPU tests without its API cases (w4_kernel runs those: each
# autotunes every tile); align takes $ALIGN_MODELS and $ALIGN_LIMIT s;
# quant_rows = the one-launch FP8 row quantizer against its torch twin on the GPU (bit for bit);
# prefill_profile = the FP8 expert MLP through auto at prefill, eager and from a CUDA graph, beside DeepGEMM's bare
# GEMMs, each row's kernels, GPU span and CUDA runtime calls per call (where an eager call makes the GPU wait;
# $PROFILE_MODELS, $PROFILE_ROWS, $PROFILE_LIMIT s);
# invariant = the batch-invariant mode's GPU tests (its tile classes re-checked on this GPU, slow cases included) and
# its cost (scripts/bench_invariant.py, Kimi-K2's and Step3's shares); invariant_checks = its quantized-checkpoint and
# bits-class GPU tests alone; first_calls = the eager-graph and warm-up GPU tests and
# scripts/bench_warmup.py; tiles = this GPU class's grouped-MLP tile table (scripts/tune_tiles.py, into $OUT/tiles;
# copy it into moe_ref/kernels/experts/tile_table.json with --install from a tree); bench = `moe-ref bench` on this GPU
# (every implementation that runs here, the peers' when .whl/ holds their files, checked then timed; $BENCH_LIMIT s);
# bench_tuned = moe_ref's Triton step beside the peers at their best (peer:*+tuned: a search of their own tuner's
# space per case) at T 512 and 4096 ($BENCH_LIMIT s, default 580);
# bench_kernels = the expert MLPs alone on one pool (moe-ref bench --kind experts: moe_ref's backends and the peers'
# kernels, kernel-only rows) at Kimi-K2's share, T 8, 64, 512, 4096 (64 to 32768 routed rows; $BENCH_LIMIT s; timed by
# $TIMER: events (default), graph or kernels, moe-ref bench --timer);
# conform_gpu = the conformance harness's GPU tests (every GPU adapter over the real shapes, the graph check, the
# timers; $CONFORM_K picks some, e.g. CONFORM_K="experts or graph"; needs .whl/ for DeepGEMM and the peers);
# probe_w4 = which W4A16 tiles give a row the same bits (INT4, MXFP4; scripts/probe_tile_bits.py --only w4: the question
# the batch-invariant mode's 4-bit experts on CUDA wait on);
# probe_fp8 = which tiles of the FP8 grouped MLP give a row the same bits (every FP8 tile, schedule, load path);
# probe_deep_gemm = whether DeepGEMM's experts give a row the same bits in pools of every size, and the mode's Triton
# bits (bf16, FP8, or $PROBE_PRECISION alone; needs .whl/: the batch-invariant mode runs DeepGEMM only where it does);
# quant_layer = the layer with its experts from synthetic checkpoints (INT4, MXFP4, FP8 blocks, as users load theirs)
# against random bf16 weights, T 16, 128, 1024, eager and from a graph (scripts/bench_eager.py --weights);
# quant_layer_invariant = the same in the batch-invariant mode (MOE_REF_BATCH_INVARIANT=1; quant_layer's rows are its
# default-mode anchors);
# w4_prefill = the 4-bit experts at 1024 and 4096 rows through the API beside bf16 and FP8 (W4A16 and W4A8), and every
# tile of the W4A16 kernel forced there (is the prefill regime's tile list the right one?);
# w4a8 = the W4A8 kernel's GPU tests (its fp8 weights bit for bit on each decode route), then the 4-bit experts at
# 4096 and 8192 rows (the layer's T = 1024) through the API, W4A16 and W4A8 beside bf16 and FP8;
# quant_layer_a8 = quant_layer's 4-bit rows with W4A8 from 64 rows per expert (MOE_REF_W4A8_ROWS_PER_EXPERT=64);
# invariant_fp8 = the batch-invariant mode's GPU tests of its FP8 and quantized paths (DeepGEMM where auto ranks it;
# needs .whl/), then its cost at Kimi-K2's share (invariant's bench, one model);
# pack = $OUT into $OUT.tgz, last (the device returns a limited number of files per command).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
MODE=${1:-quick}; shift || true
STEPS=${*:-info tests tests_slow tests2 dist graph mega peer_check bench_experts bench_layer layer1 eager w4 align}
mkdir -p "$OUT" "$OUT/bench"
LOG="$OUT/suite.log"
# Keep NVLink multicast off (it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# The engine wheels (sglang/vllm) are only read with zipfile (moe_ref.bench.peers, scripts/peer_moe.py): never installed.
PEER_FILES=$(ls .whl/sglang-*.whl .whl/*-fused-moe.zip 2>/dev/null)  # the peer scripts read every one of them
INSTALL_WHEELS=$(ls .whl/*.whl 2>/dev/null | grep -v -E '/(sglang|vllm)-')
if [ -n "$INSTALL_WHEELS" ]; then  # optional DeepGEMM wheels carried from a CPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $INSTALL_WHEELS \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
status=0

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
}

for s in $STEPS; do case $s in
  info) step info 120 python3 -m moe_ref info ;;
  tests) step tests 420 python3 -m pytest -q -rs --timeout=300 -m "cuda and not cuda2 and not slow" tests/gpu --durations=15 ;;
  tests_slow) step tests_slow 590 python3 -m pytest -q -rs --timeout=300 -m "cuda and not cuda2 and slow" tests/gpu --durations=15 ;;
  mega)
    if [ "$NGPU" -ge 2 ]; then
      step mega 420 $TORCHRUN tests/gpu/mega_worker.py --json "$OUT/mega_worker.json"
    fi ;;
  dist)
    if [ "$NGPU" -ge 2 ]; then
      for t in symm a2a; do
        step "dist_$t" 300 $TORCHRUN -m moe_ref.tools.dist_check --device cuda --dtype bf16 --preset tiny-kimi-k2 \
          --transport $t --tokens-per-rank 300 --cap 128 --overflow chunk --json "$OUT/dist_$t.json"
      done
      step dist_k3 300 $TORCHRUN -m moe_ref.tools.dist_check --device cuda --dtype bf16 --preset tiny-kimi-k3 --cap 64
    else echo "=== dist skipped: $NGPU GPU(s)" | tee -a "$LOG"; fi ;;
  tests2)
    if [ "$NGPU" -ge 2 ]; then step tests2 420 python3 -m pytest -q -rs --timeout=400 -m cuda2 tests/dist tests/gpu; fi ;;
  graph)
    step graph1 300 python3 tests/gpu/graph_worker.py --out "$OUT/graph1"
    if [ "$NGPU" -ge 2 ]; then step graph2 300 $TORCHRUN tests/gpu/graph_worker.py --out "$OUT/graph2"; fi ;;
  peer_check)
    if [ -n "$PEER_FILES" ]; then step peer_check 300 python3 scripts/peer_moe.py --check
    else echo "=== peer_check skipped: no peer files in .whl/ (make peers)" | tee -a "$LOG"; fi ;;
  bench_experts) step bench_experts 600 python3 scripts/bench_experts.py $([ "$MODE" = quick ] && echo --quick) \
      --include-deep-gemm --out "$OUT/bench_experts.json" ;;
  bench_layer)
    if [ "$NGPU" -ge 2 ]; then step bench_layer 540 $TORCHRUN scripts/bench_layer.py --out "$OUT/layer"; fi ;;
  layer1)
    step layer1 540 python3 scripts/bench_layer.py --out "$OUT/layer1" --num-experts 192
    step profile1 300 python3 scripts/profile_step.py --out "$OUT/prof1" --num-experts 192 ;;
  eager)
    step eager 420 python3 scripts/bench_eager.py --out "$OUT/eager" --profile --ab-bound-launch --tokens 16 128 1024 4096
    step eager_compile 200 python3 scripts/bench_eager.py --out "$OUT/eager_compile" --tokens 128 \
      --routes eager graph compile ;;
  auto_table) step auto_table 590 python3 -m moe_ref bench --auto-table "$OUT/auto_table.json" --max-seconds 480 ;;
  w4_kernel)
    step w4_tests 400 python3 -m pytest -q -rs --timeout=250 tests/interpreter/test_grouped_mlp_w4.py \
      tests/gpu/test_quant_cuda.py
    step w4_bench 300 python3 scripts/bench_w4a16.py --peer first --max-seconds 280 --out "$OUT/w4/bench_w4a16.json" ;;
  auto_check|auto_bench)
    if [ "$s" = auto_check ]; then
      step auto_tests 240 python3 -m pytest -q -rs --timeout=200 tests/gpu/test_auto_experts_cuda.py tests/gpu/test_deep_gemm.py
    fi
    step auto_bench "${AUTO_LIMIT:-300}" python3 scripts/bench_experts.py --include-deep-gemm --peer-search none --quick \
      --models kimi-k2,step3 --rows "${AUTO_ROWS:-64,4096,32768}" --graph \
      --paths "${AUTO_PATHS:-api_auto_,api_deep_gemm_,api_triton_,deep_gemm_kernels_}" --rounds "${AUTO_ROUNDS:-1}" \
      --out "$OUT/auto_check/bench_experts.json" ;;
  fp8_tests)  # the FP8 cases only (the 4-bit ones autotune for ~30 s each: w4_kernel runs them)
    step fp8_layer_tests 150 python3 -m pytest -q -rs --timeout=120 tests/gpu/test_quant_cuda.py \
      tests/gpu/test_fp8_layer_cuda.py -k "fp8 or load"
    step fp8_auto_tests 240 python3 -m pytest -q -rs --timeout=200 tests/gpu/test_auto_experts_cuda.py tests/gpu/test_deep_gemm.py ;;
  quant_rows) step quant_rows 150 python3 -m pytest -q -rs --timeout=120 tests/gpu/test_kernels_cuda.py -k quantize_rows ;;
  w4_tests) step w4_tests 240 python3 -m pytest -q -rs --timeout=120 tests/interpreter/test_grouped_mlp_w4.py \
      -k "decode or scale or forced or no_rows or twin or every_tile or a8" ;;
  w4a8)
    step w4a8_tests 280 python3 -m pytest -q -rs --timeout=200 tests/interpreter/test_grouped_mlp_w4.py -k a8
    step w4a8_bench 280 python3 scripts/bench_w4a16.py --peer none --rows 4096 8192 --max-seconds 260 \
      --out "$OUT/w4a8/bench_w4a16.json" ;;
  quant_layer_a8) MOE_REF_W4A8_ROWS_PER_EXPERT=64 step quant_layer_a8 400 python3 scripts/bench_eager.py \
      --out "$OUT/quant_layer_a8" --dispatch bf16 --weights random int4_group mxfp4 --tokens 128 1024 \
      --routes eager graph --calls 20 --repeats 3 ;;
  quant_layer) step quant_layer 590 python3 scripts/bench_eager.py --out "$OUT/quant_layer" --dispatch bf16 \
      --weights random int4_group mxfp4 fp8_block --tokens 16 128 1024 --routes eager graph --calls 20 --repeats 3 ;;
  quant_layer_invariant) MOE_REF_BATCH_INVARIANT=1 step quant_layer_invariant 590 python3 scripts/bench_eager.py \
      --out "$OUT/quant_layer_invariant" --dispatch bf16 --weights random int4_group mxfp4 fp8_block --tokens 16 128 1024 \
      --routes eager graph --calls 20 --repeats 3 ;;
  w4_prefill) step w4_prefill 360 python3 scripts/bench_w4a16.py --peer none --rows ${W4_ROWS:-1024 4096} --sweep --every-tile \
      --max-seconds 330 --out "$OUT/w4_prefill/bench_w4a16.json" ;;
  w4_api) step w4_api 200 python3 scripts/bench_w4a16.py --peer none --out "$OUT/w4_api/bench_w4a16.json" ;;
  launch)
    step launch_tests 200 python3 -m pytest -q -rs --timeout=150 tests/gpu/test_bound_launch_cuda.py tests/unit/test_bound_launch.py
    step launch 150 python3 scripts/bench_launch.py --out "$OUT/launch" ;;
  router)
    step router_tests 200 python3 -m pytest -q -rs --timeout=150 tests/gpu/test_kernels_cuda.py -k router \
      tests/unit/test_router_logits.py
    step router 200 python3 scripts/bench_router.py --out "$OUT/router" ;;
  peer:*:*)
    IFS=: read -r _ model rows <<< "$s"
    step "peer_${model}_${rows}" "${PEER_LIMIT:-590}" python3 scripts/bench_experts.py --include-deep-gemm --peer-search small \
      --models "$model" --rows "$rows" --rounds "${PEER_ROUNDS:-2}" --paths api_auto_,api_triton_,peer_,deep_gemm_kernels_,grouped_mm_ \
      --out "$OUT/peer_${model}_${rows}/bench_experts.json" ;;
  prefill_profile) step prefill_profile "${PROFILE_LIMIT:-200}" python3 scripts/bench_experts.py --include-deep-gemm \
      --peer-search none --quick --models "${PROFILE_MODELS:-kimi-k2}" --rows "${PROFILE_ROWS:-4096,32768}" \
      --paths api_auto_fp8,deep_gemm_kernels_fp8 --graph --rounds 2 --kernel-table \
      --out "$OUT/prefill_profile/bench_experts.json" ;;
  epilogue_add) step epilogue_add 120 python3 -m pytest -q -rs --timeout=100 tests/interpreter/test_grouped_mlp.py -k add ;;
  launches) step launches 200 python3 scripts/bench_eager.py --out "$OUT/launches" --tokens 16 128 \
      --routes eager_launches graph --profile --repeats 5 ;;
  layout)
    step layout_kernel 150 python3 -m pytest -q -rs --timeout=120 tests/gpu/test_kernels_cuda.py -k grouped_mlp_fp8
    step layout_ab 260 python3 scripts/ab_grouped_mlp.py --ab layout --models kimi-k2,step3 --rows 64,512,4096,32768 \
      --precisions fp8 --max-seconds "${LAYOUT_SECONDS:-230}" --out "$OUT/layout/ab_layout.json" ;;
  pack) PACK=1 ;;  # done after the summary below
  w4) step w4 300 python3 scripts/bench_w4a16.py --sweep --max-seconds 270 --out "$OUT/w4_sweep/bench_w4a16.json" ;;
  schedule) step schedule 300 python3 scripts/ab_grouped_mlp.py --ab schedule --rows "${SCHEDULE_ROWS:-64,512,4096,32768}" \
      --max-seconds 280 --out "$OUT/schedule/ab_schedule.json" ;;
  align) step align "${ALIGN_LIMIT:-300}" python3 scripts/ab_grouped_mlp.py --ab alignment --nohint \
      --models "${ALIGN_MODELS:-kimi-k2,step3}" --max-seconds "$(( ${ALIGN_LIMIT:-300} - 30 ))" \
      --out "$OUT/align/ab_alignment.json" ;;
  invariant)
    step invariant_tests 260 python3 -m pytest -q -rs --timeout=180 tests/gpu/test_batch_invariant_cuda.py \
      -k "not every_tile_of_a_grouped"  # the slow one is invariant_checks' (one compile per tile)
    step invariant_cost 300 python3 scripts/bench_invariant.py --models kimi-k2/48 step3/48 --kernel-table 4096 \
      --out "$OUT/invariant" ;;
  invariant_fp8)  # the mode's FP8 experts on DeepGEMM where auto ranks it: the GPU tests, then the cost at Kimi-K2
    step invariant_fp8_tests 240 python3 -m pytest -q -rs --timeout=200 tests/gpu/test_batch_invariant_cuda.py \
      -k "deep_gemm or quantized or token_alone_equals"
    step invariant_fp8_cost 240 python3 scripts/bench_invariant.py --models kimi-k2/48 --out "$OUT/invariant" ;;
  invariant_checks) step invariant_checks 200 python3 -m pytest -q -rs --timeout=180 tests/gpu/test_batch_invariant_cuda.py \
      -k "quantized or every_tile" ;;
  first_calls)
    step first_calls_tests 120 python3 -m pytest -q -rs --timeout=100 tests/gpu/test_eager_graphs_cuda.py
    step first_calls 240 python3 scripts/bench_warmup.py --out "$OUT/warmup" --modes default launch ;;
  bench) step bench "${BENCH_LIMIT:-300}" python3 -m moe_ref bench --device cuda --table "$OUT/bench/bench.md" \
      --jsonl "$OUT/bench/bench.jsonl" ;;
  bench_tuned) step bench_tuned "${BENCH_LIMIT:-580}" python3 -m moe_ref bench --device cuda --tokens 512,4096 \
      --impl moe_ref/triton --impl peer:sglang+tuned --impl peer:vllm+tuned --table "$OUT/bench/bench_tuned.md" \
      --jsonl "$OUT/bench/bench_tuned.jsonl" ;;
  bench_kernels) step bench_kernels "${BENCH_LIMIT:-400}" python3 -m moe_ref bench --device cuda --kind experts \
      --tokens 8,64,512,4096 --timer "${TIMER:-events}" --table "$OUT/bench/bench_kernels_${TIMER:-events}.md" \
      --jsonl "$OUT/bench/bench_kernels_${TIMER:-events}.jsonl" ;;
  tiles) step tiles 590 python3 scripts/tune_tiles.py --out "$OUT/tiles" --models kimi-k2/48 ;;
  probe_w4) step probe_w4 400 python3 scripts/probe_tile_bits.py --only w4 --out "$OUT/probe" ;;
  probe_fp8) step probe_fp8 240 python3 scripts/probe_tile_bits.py --only grouped --precision fp8 --out "$OUT/probe_fp8" ;;
  probe_deep_gemm) step probe_deep_gemm 300 python3 scripts/probe_tile_bits.py --only deep_gemm \
      ${PROBE_PRECISION:+--precision "$PROBE_PRECISION"} --out "$OUT/probe_dg" ;;
  conform_gpu) step conform_gpu "${CONFORM_LIMIT:-580}" python3 -m pytest -q -rs --timeout=570 \
      tests/gpu/test_conformance_cuda.py ${CONFORM_K:+-k "$CONFORM_K"} --durations=10 ;;
  *) echo "unknown step $s" ;;
esac; done
echo "=== suite done, status=$status" | tee -a "$LOG"
grep -E "^=== |passed|failed|RESULT|error" "$LOG" | tail -n 60
if [ "${PACK:-0}" = 1 ]; then
  tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT" && echo "=== packed $OUT.tgz"
fi
exit $status
