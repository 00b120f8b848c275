#!/usr/bin/env bash
# The GPU check: megalm's GPU tier (tests/gpu and the CUDA paths of the unit tests), its quick benchmarks, the HDP
# cost-model calibration and the peer comparison, on one machine with a CUDA GPU. Run in steps that each fit ten
# minutes; every step appends its lines to the report as it goes, so a step killed by a time limit leaves what it
# wrote (docs/benchmarks.md, "The GPU tier").
#
# THE GPU RUN (printed by `tools/gpu_check.sh --print-run`, and when the wheels are missing):
GPU_RUN='The GPU run. Where pip reaches an index: tools/gpu_wheels.sh && tools/compare_wheels.sh (fills the
git-ignored .wheels/ and .whl/). Copy the checkout with .wheels/ and .whl/ to the GPU machine (one H100 or H200,
torch with CUDA, no network needed); from its root run
    OUT=DIR tools/gpu_check.sh setup compare_accumulated throughput
        (9.5 minutes: first 1.3B at seq 4096 against the peers at 4 micro-batches a step, megalm with its speed
        options: the cell of the 55% goal, about 4 minutes; then the rows of the fast step, compiled bf16 and the
        fp8 A/Bs first, as far as the budget goes)
    OUT=DIR tools/gpu_check.sh setup tests                (the GPU tier: 227 s in one process on 2026-11-29, on 4
                                                           workers since; GPU_CHECK_TESTS="PATH ..." for a part)
and, if time is left,
    OUT=DIR tools/gpu_check.sh setup compare              (the same at one micro-batch a step, bf16 and fp8, ~5 min)
    OUT=DIR tools/gpu_check.sh setup bench                (first the rows that decide a default: fused weight
                                                           gradients, the MoE and zero-bubble compile defaults;
                                                           then the other benchmarks)
    OUT=DIR tools/gpu_check.sh setup calibrate            (the HDP cost model on this GPU: 2026-11-28 has it)
Each call stays under ten minutes; what its budget leaves out is "not run". The report is DIR/gpu_check_report.md,
the full output DIR/gpu_check.log. With the device tool: carry [".wheels", ".whl"]; the first command as
"OUT=$OUT GPU_CHECK_BUDGET_S=570 GPU_CHECK_COMMIT=<git rev-parse --short HEAD> tools/gpu_check.sh setup
compare_accumulated throughput" (timeout_s 600; the copy has no .git: the commit names the report), then at once
(the machine goes back after 30 s idle) the second, its GPU_CHECK_BUDGET_S a minute under the device time left.
A 15-minute device budget holds the start of the machine, the first call and a short second: on 2026-12-05 the
start and "setup throughput tests" (553 s) left no room for the cell of the goal.'
#
# Usage: tools/gpu_check.sh [--dry-run] [--print-run] [STEP ...]
#   STEP: setup throughput tests calibrate bench compare compare_accumulated, run in the order given (default: all
#         seven, in this order); setup always runs first. throughput: the fast step's rows (1.3B at seq 4096, bf16 and
#         fp8, eager and compiled, profiled) and the kernels behind them (FP8 GEMMs, AdamW); bench: the
#         other benchmarks; compare: megalm against its peers; compare_accumulated: the same at 4 micro-batches a
#         step. The GPU run puts the goal's cell (compare_accumulated) and the fast step's numbers before the tests.
#   --dry-run: the whole script on a machine without a GPU (CI runs it): setup only reports, the tests are the GPU
#              tier (skipped there) and the fake-CUDA tier, each benchmark is asked for --help, calibration and the
#              comparison run their CPU sizes. Exit 0 when all of that works.
# Exit: 0 every test passed and nothing failed (a benchmark cut by the time budget is "not run", not a failure);
# 1 a test or a step failed; 2 no CUDA device (and not --dry-run); 3 the dependencies cannot be installed.
# Environment: PYTHON (default python3), WHEELS (.wheels), PEER_WHEELS (.whl), OUT (a folder, or a .md file; default
# the folder it is called from; a relative OUT is relative to it), GPU_CHECK_BUDGET_S (default 540: one invocation's
# time, counted from its start; what would start later is not run, so the whole call stays under ten minutes),
# GPU_CHECK_TEST_WORKERS (the tests step's pytest-xdist workers where it is installed: 4 on a GPU, 1 (one process) in
# a dry run), GPU_CHECK_TESTS (the tests step's test paths instead of the tier's, space-separated: a partial re-run).
set -uo pipefail
start=$SECONDS
CALLER=$(pwd)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.wheels}
PEER_WHEELS=${PEER_WHEELS:-.whl}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
DRY_RUN=0
STEPS=()
wants() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --print-run) echo "$GPU_RUN"; exit 0 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    setup|throughput|tests|calibrate|bench|compare|compare_accumulated) wants "$arg" || STEPS+=("$arg") ;;  # once
    *) echo "gpu_check: unknown argument '$arg'; steps are setup throughput tests calibrate bench compare" \
            "compare_accumulated (or --dry-run)" >&2
       exit 2 ;;
  esac
done
((${#STEPS[@]})) || STEPS=(setup throughput tests calibrate bench compare compare_accumulated)
# the tests step's pytest-xdist workers: 4 on a GPU, one process in a dry run (CI's), unless set
TEST_WORKERS=${GPU_CHECK_TEST_WORKERS:-$( ((DRY_RUN)) && echo 1 || echo 4)}
if [[ ! "$TEST_WORKERS" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu_check: GPU_CHECK_TEST_WORKERS=$TEST_WORKERS is not a count of workers; give a number (1: one process)" >&2
  exit 2
fi

# ------------------------------------------------------------------------------------------------ a CUDA GPU
if ! "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
  echo "gpu_check: $PYTHON cannot import torch; install a CUDA build of PyTorch (or set PYTHON=...)." >&2
  exit 2
fi
if ((!DRY_RUN)) && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is False for $PYTHON); the GPU tier needs" \
       "one, so nothing was run. On a CPU machine: tools/gpu_check.sh --dry-run, or the default suite: pytest" >&2
  exit 2
fi

OUT=${OUT:-$CALLER}
[[ "$OUT" == /* ]] || OUT="$CALLER/$OUT"
if [[ "$OUT" == *.md ]]; then REPORT=$OUT; else REPORT="$OUT/gpu_check_report.md"; fi
mkdir -p "$(dirname "$REPORT")"
OUT_DIR=$(cd "$(dirname "$REPORT")" && pwd)
LOG="$OUT_DIR/gpu_check.log"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # megalm importable even if the editable install fails
# Bit-equality tests on a GPU mean it only with deterministic cuBLAS: set before any CUDA context exists.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
((DRY_RUN)) || unset TRITON_INTERPRET  # on the GPU the MX kernel's tests run compiled, not interpreted
failures=()
last_rc=0 last_s=0 last_status=skipped
say() { echo "gpu_check: $*" | tee -a "$LOG"; }
report() { printf '%s\n' "$@" >>"$REPORT"; }
left() { echo $((BUDGET_S - (SECONDS - start))); }
[ -s "$REPORT" ] || "$PYTHON" tools/gpu_check_report.py header "$REPORT" $( ((DRY_RUN)) && echo --dry-run)
report "" "## Run of $(date -u +%H:%M) UTC: ${STEPS[*]}$( ((DRY_RUN)) && echo ' (dry run)'), budget ${BUDGET_S} s"

# run NAME LIMIT_S CMD...: one measured command within what is left of the budget; appends its status and the tail
# of its output to the report. Cut by a time limit (its own or the budget's): "not run", never "failed".
run() {
  local name=$1 limit=$2 rc t0 status remaining log
  shift 2
  remaining=$(left)
  last_status=skipped last_rc=0 last_s=0
  if ((remaining < 30)); then
    say "$name: not run (the ${BUDGET_S} s budget is spent)"
    report "" "### $name: not run (the ${BUDGET_S} s budget was spent before it could start)"
    return
  fi
  ((limit > remaining)) && limit=$remaining
  log="$WORK/$(echo "$name" | tr -c 'A-Za-z0-9' _).log"
  report "" "### $name" "" "\`${*/#$PYTHON/python}\` (started $(date -u +%H:%M:%S), at most $limit s)"
  say "$name: $* (at most $limit s)"
  t0=$SECONDS
  # -k: the trainer takes SIGTERM as a preemption (a flag a bench loop never reads): KILL follows 10 s later
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  last_rc=$rc last_s=$((SECONDS - t0))
  if ((rc == 0)); then
    status="ok, $last_s s" last_status=ok
  elif ((rc == 124 || (rc == 137 && last_s >= limit - 1))); then  # timeout's 124, or its KILL after the limit
    status="not run to the end: cut by its $limit s limit" last_status=cut
  else
    status="failed (exit $rc), $last_s s" last_status=failed
    failures+=("$name")
  fi
  report "" "$status" "" '```' "$(grep -v '^\s*$' "$log" | tail -n 20)" '```'
}

# ------------------------------------------------------------------------------------------------------ setup
# What .wheels/ carries (pure Python), and megalm's other needs, which a CUDA image with PyTorch has.
missing=$("$PYTHON" - <<'EOF'
import importlib.util
carried = {"hydra": "hydra-core", "omegaconf": "omegaconf", "pytest_timeout": "pytest-timeout"}
print(" ".join(package for module, package in carried.items() if importlib.util.find_spec(module) is None))
EOF
)
absent=$("$PYTHON" - <<'EOF'
import importlib.util
needed = {"numpy": "numpy", "safetensors": "safetensors", "tokenizers": "tokenizers", "tqdm": "tqdm",
          "yaml": "pyyaml", "packaging": "packaging", "pytest": "pytest", "triton": "triton"}
print(" ".join(package for module, package in needed.items() if importlib.util.find_spec(module) is None))
EOF
)
report "" "### setup"
if [ -n "$absent" ]; then
  echo "gpu_check: $PYTHON lacks $absent, which megalm or its GPU tests need and $WHEELS/ does not carry;" \
       "install them (pip install $absent) and run again." | tee -a "$LOG" >&2
  report "" "failed: $PYTHON lacks $absent"
  exit 3
fi
if [ -n "$missing" ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    { echo "gpu_check: $PYTHON lacks $missing and $WHEELS/ holds no wheels."; echo "$GPU_RUN"; } | tee -a "$LOG" >&2
    report "" "failed: $PYTHON lacks $missing and $WHEELS/ holds no wheels (tools/gpu_check.sh --print-run)"
    exit 3
  fi
  if ((DRY_RUN)); then
    report "" "dry run: would install $missing from $WHEELS/"
  else
    say "installing $missing from $WHEELS/"
    # shellcheck disable=SC2086  # one word per package
    if ! "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" $missing >>"$LOG" 2>&1; then
      echo "gpu_check: pip could not install $missing from $WHEELS/ (see $LOG)" >&2
      report "" "failed: pip could not install $missing from $WHEELS/"
      exit 3
    fi
  fi
fi
# torchao (precision.backend=torchao) is optional: installed from $WHEELS/ when the image lacks it and its wheel is there
if ! "$PYTHON" -c "import torchao" >/dev/null 2>&1; then
  if ((DRY_RUN)); then
    report "" "dry run: would install torchao from $WHEELS/ if its wheel is there"
  elif ls "$WHEELS"/torchao-*.whl >/dev/null 2>&1 && "$PYTHON" -m pip install -q --no-index --no-deps \
      "$WHEELS"/torchao-*.whl >>"$LOG" 2>&1; then
    report "" "torchao installed from $WHEELS/ (precision.backend=torchao)"
  else
    report "" "torchao not installed (no wheel in $WHEELS/: tools/gpu_wheels.sh adds it); its GPU test skips"
  fi
fi
# pytest-xdist (the tests step's workers) is optional as well: from $WHEELS/ when the image lacks it
if ! "$PYTHON" -c "import xdist" >/dev/null 2>&1; then
  if ((DRY_RUN)); then
    report "" "dry run: would install pytest-xdist from $WHEELS/ if its wheels are there"
  elif ls "$WHEELS"/pytest_xdist-*.whl >/dev/null 2>&1 && "$PYTHON" -m pip install -q --no-index \
      --find-links "$WHEELS" pytest-xdist >>"$LOG" 2>&1; then
    report "" "pytest-xdist installed from $WHEELS/ (the tests step runs $TEST_WORKERS workers)"
  else
    report "" "pytest-xdist not installed (no wheel in $WHEELS/: tools/gpu_wheels.sh adds it); the tests run in one" \
      "process"
  fi
fi
if ((DRY_RUN)); then
  report "" "dry run: megalm from $ROOT through PYTHONPATH"
elif "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
  report "" "megalm installed editable (pip install --no-deps -e .)"
else
  report "" "pip install -e . failed (see the log); megalm imported from $ROOT through PYTHONPATH"
fi

# The device's facts, read once: compute capability, GPU count, a short name (h100, h200, a100, b200, ...)
read -r capability gpus gpu_name < <("$PYTHON" tools/gpu_check_report.py device)
case "$gpu_name" in a100|h100|h200|b200) ROOFLINE_GPU=$gpu_name ;; *) ROOFLINE_GPU=h100 ;; esac  # step_cost.py's --gpu

# ------------------------------------------------------------------------------------------------------ tests
step_tests() {
  local given=${GPU_CHECK_TESTS:-}
  if [ -n "${given// /}" ]; then  # a partial re-run: e.g. the files that failed last time
    read -r -a TESTS <<<"$given"
  elif ((DRY_RUN)); then  # on CPU: the GPU tier collects and skips; the fake-CUDA tier runs (or skips on a CPU torch)
    TESTS=(tests/gpu tests/unit/test_fake_cuda.py)
  else
    TESTS=(tests/gpu tests/unit/test_fake_cuda.py tests/unit/test_mx_gemm_fused.py tests/unit/test_mx_triton.py
           tests/unit/test_ring_kernels.py tests/unit/test_adamw_kernel.py)
  fi
  # On a GPU, TEST_WORKERS pytest-xdist workers share the GPU and the host's cores, whole files each, where
  # pytest-xdist is installed (.wheels/ carries it): serially the tier took 227 s of a 15-minute device budget
  # (2026-11-29), much of it the CPU's fp32 references. The tests that fail beside others run again alone, below.
  local workers=() threads=() failed
  if ((TEST_WORKERS > 1)) && "$PYTHON" -c "import xdist" >/dev/null 2>&1; then
    workers=(-n "$TEST_WORKERS" --dist loadfile)  # and the cores shared between them, not each taking all
    threads=(OMP_NUM_THREADS=$(($(nproc) / TEST_WORKERS > 0 ? $(nproc) / TEST_WORKERS : 1)))
  fi
  # `-m "gpu or not slow"`: the gpu tests, and the unit files' tests, which carry no marker
  # --timeout 90: a hung test fails alone and the others are still counted (addopts' 600 s exceeds the step)
  # --ignore: this script's own tests are CPU tests of the default suite, which run this script again (inside a dry
  # run: 31 of its 43 s on the CPU, 2026-12-02; on the GPU, device time)
  # cache_dir: pytest's record of what failed (for --last-failed below), kept out of the checkout
  local pytest_args=(-m "gpu or not slow" -rfEs -q --ignore=tests/gpu/test_gpu_check_script.py --timeout 90
                     -o cache_dir="$WORK/pytest_cache")
  run "tests" 420 env "${threads[@]}" "$PYTHON" -m pytest "${TESTS[@]}" "${workers[@]}" \
    "${pytest_args[@]}" --junitxml="$WORK/junit.xml"
  if [[ "$last_status" == ok || "$last_status" == failed ]]; then  # cut or not started: no verdict on the tests
    summary=$("$PYTHON" tools/gpu_check_report.py junit "$WORK/junit.xml" "$last_rc" "$last_s" 2>&1) \
      || [[ " ${failures[*]} " == *" tests "* ]] || failures+=("tests")
    report "" "$summary"
  fi
  # beside other workers only, and few: more than 20 failing at once is no neighbour's doing
  ((${#workers[@]})) && [[ "$last_status" == failed ]] || return 0
  failed=$("$PYTHON" tools/gpu_check_report.py failed "$WORK/junit.xml" 2>/dev/null)  # tests, not failure lines
  ((${failed:-0} > 0 && ${failed:-0} <= 20)) || return 0
  run "tests that failed beside others, again in one process ($failed)" 240 "$PYTHON" -m pytest "${TESTS[@]}" \
    "${pytest_args[@]}" --last-failed --last-failed-no-failures none --junitxml="$WORK/junit_again.xml"
  if [[ "$last_status" == ok ]]; then  # each passed alone: what failed was running beside other tests
    local kept=() name
    for name in "${failures[@]}"; do [ "$name" = tests ] || kept+=("$name"); done
    failures=("${kept[@]}")
    report "" "Each test that failed beside the others passed alone: the failures above came from the workers" \
      "sharing one GPU and host, not from megalm; they do not fail this run."
  elif [[ "$last_status" == failed ]]; then
    report "" "$("$PYTHON" tools/gpu_check_report.py junit "$WORK/junit_again.xml" "$last_rc" "$last_s" 2>&1)"
  fi
}

# -------------------------------------------------------------------------------------------------- calibrate
step_calibrate() {
  if ((DRY_RUN)); then
    # a budget of 90 s, counted from the process start: beside CI's other long tests a 30 s one was spent before
    # the first point (its imports on a busy 2-core machine)
    run "HDP cost-model calibration (dry run: tiny model on CPU)" 150 "$PYTHON" tools/bench/hdp_calibrate.py \
      model=tiny --device cpu --base configs/hdp_cost/h100_7b.yaml --out "$OUT_DIR/hdp_cost_dry_run.yaml" \
      --budget-s 90
  else
    # written where the repository keeps it: `cp -r OUT/configs .` replaces the roofline-derived file (docs/hdp.md)
    mkdir -p "$OUT_DIR/configs/hdp_cost"
    run "HDP cost-model calibration, 7b" 240 "$PYTHON" tools/bench/hdp_calibrate.py model=7b --device cuda \
      --base configs/hdp_cost/h100_7b.yaml --out "$OUT_DIR/configs/hdp_cost/${gpu_name}_7b.yaml" --budget-s 200
  fi
}

# ------------------------------------------------------------------------------------------------- benchmarks
declare -A HELPED=()  # dry run: the scripts whose --help ran ok (a second row of the same script only says so)
bench() {  # bench NAME LIMIT_S SCRIPT ARGS...: on the GPU as given; in a dry run the script's --help only
  local name=$1 limit=$2 script=$3
  shift 3
  if ((DRY_RUN)) && [ -n "${HELPED[$script]:-}" ]; then
    report "" "### $name (dry run: $script's imports and --help ran above; this row's arguments are not parsed)"
  elif ((DRY_RUN)); then
    run "$name (dry run: its imports and --help, not this row's arguments)" 60 "$PYTHON" "$script" --help
    if [ "$last_status" = ok ]; then HELPED[$script]=1; fi
  else
    run "$name" "$limit" "$PYTHON" "$script" "$@"
  fi
}
step_throughput() {
  # the fast step's goal: 1.3B at seq 4096, bf16 and fp8, compiled (inductor per block) and eager; each then
  # profiles 2 steps (--profile: GPU busy against wall time, time per kind of kernel, the top kernels, host syncs).
  # The rows that decide something first (a call whose budget runs out cuts the last): compiled bf16, the base of
  # every fp8 ratio; the fp8 A/Bs; then eager bf16, measured on two GPUs already (compile's gain)
  bench "training throughput, 1.3b/4096 bf16 compiled" 240 tools/bench/throughput.py model=1.3b \
    model.seq_length=4096 precision=bf16 trainer.compile=true trainer.global_batch_size=2 \
    trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2
  if ((DRY_RUN || capability >= 89)); then
    # compiled (the default on CUDA): the casts in the block's graph, fused by inductor, the GEMMs torch._scaled_mm
    bench "training throughput, 1.3b/4096 fp8 compiled" 240 tools/bench/throughput.py model=1.3b \
      model.seq_length=4096 precision=fp8 trainer.compile=true trainer.global_batch_size=2 \
      trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2
    # the same with FP8's column-major copies (wgrad's operands) in kernels of their own, not their casts' (inductor's
    # layout prim, since 2026-12-03): on one H100 (2026-12-05) the row-wise Triton kernels that wrote them took 11.6
    # of this row's 39.4 ms of Triton kernels. The two rows side by side decide the default.
    bench "training throughput, 1.3b/4096 fp8 compiled, --fp8-columns-apart" 240 tools/bench/throughput.py \
      model=1.3b model.seq_length=4096 precision=fp8 trainer.compile=true trainer.global_batch_size=2 \
      trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2 --fp8-columns-apart
    # the same recipe through torchao's Float8Linear (TorchTitan's fp8: 1.16x its bf16 on 2026-11-28) in megalm's
    # trainer: the two FP8 backends differ in nothing else. Traced, compiled, within 2.4% of each other (2026-11-28);
    # no GPU row has compared them yet, and the faster one should be CUDA's default.
    if ((DRY_RUN)) || "$PYTHON" -c "import torchao" >/dev/null 2>&1; then
      bench "training throughput, 1.3b/4096 fp8 compiled, torchao's Float8Linear" 240 tools/bench/throughput.py \
        model=1.3b model.seq_length=4096 precision=fp8 precision.backend=torchao trainer.compile=true \
        trainer.global_batch_size=2 trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2
    else
      report "" "### training throughput, 1.3b/4096 fp8 compiled, torchao's Float8Linear: not run (torchao is not" \
        "installed: tools/gpu_wheels.sh carries its wheel)"
    fi
    # fp8 with delayed scaling, compiled: each cast with its history's scale, one pass fused into the producer, the
    # fp8 recipe the step-cost trace favours (40.74 ms a micro-batch against current scaling's 43.83 and bf16's 50.91
    # on the H100 roofline, 2026-12-04): the fp8 goal's best candidate, so measured here, beside bf16, in the first
    # call (eager fp8, host-bound on 2026-11-29 at 0.68x bf16, moved to the bench step to make room)
    bench "training throughput, 1.3b/4096 fp8_delayed compiled" 240 tools/bench/throughput.py model=1.3b \
      model.seq_length=4096 precision=fp8_delayed trainer.compile=true trainer.global_batch_size=2 \
      trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2
  fi
  # eager bf16 (what compile gains: 1.24x on one H100, 2026-12-05)
  bench "training throughput, 1.3b/4096 bf16" 150 tools/bench/throughput.py model=1.3b model.seq_length=4096 \
    precision=bf16 trainer.compile=false trainer.global_batch_size=2 trainer.micro_batch_size=2 --steps 6 \
    --warmup 2 --profile 2
  if ((DRY_RUN || capability >= 89)); then
    # the block's GEMMs alone (seconds): bf16 against FP8, with and without fast accumulation (the fp8 recipes'
    # forward GEMM accumulates fast since 2026-12-03; the rows of 2026-11-29 did not): FP8's GEMMs ran at 44% of
    # their peak in the fp8 rows of 2026-11-29
    bench "FP8 GEMMs against bf16, a 1.3b block at 8,192 tokens" 60 tools/bench/fp8_gemms.py model=1.3b \
      model.seq_length=4096 trainer.micro_batch_size=2
  fi
  # the optimizer step (24 of the compiled bf16 step's 173 ms on 2026-11-29): torch's fused AdamW + the bf16 copy
  # against megalm's one-pass Triton kernel (optim.implementation=auto's on CUDA since this row measured it 1.37x
  # faster on an H100, 2026-12-05), over the 1.3B model's parameters
  bench "AdamW kernels, 1.3b parameters" 60 tools/bench/adamw_kernels.py model=1.3b --iters 10 --warmup 3
}
step_bench() {
  # first the rows that decide a default (trainer.compile's auto keeps MoE and zero-bubble blocks eager until they
  # are measured): the step's caps add up to more than one invocation's budget, and what comes last is cut.
  # seconds, no training: the step-cost trace's roofline against torch's own (RuntimeEstimator), which reads this
  # GPU's peak and bandwidth (tests/gpu/test_gpu_roofline.py asserts the two agree where their conventions do)
  bench "step-cost roofline against torch's, 1.3b/4096 eager" 90 tools/bench/step_cost.py --systems megalm \
    --torch-estimator --gpu "$ROOFLINE_GPU" model=1.3b model.seq_length=4096
  # Gradient accumulation fusion (opt-in until this row): the throughput step's compiled bf16 row with each
  # weight-gradient GEMM adding into its fp32 bucket (traced: 2.0 of a micro-batch's 50.9 ms on the H100 roofline).
  bench "training throughput, 1.3b/4096 bf16 with fused weight gradients (compiled)" 240 tools/bench/throughput.py \
    model=1.3b model.seq_length=4096 precision=bf16 trainer.compile=true parallel.gradient_accumulation_fusion=true \
    trainer.global_batch_size=2 trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2
  # the attention's output projection kept in bf16 under fp8 (precision.skip, beside the head): at 1.3B's width its
  # FP8 GEMMs ran slower than bf16's on one H100 (2026-12-05: 457/423/476 against 607/706/752 TFLOP/s, fp8_gemms.py),
  # and bf16 there also skips its two casts; the throughput step's fp8 compiled row is the other side
  if ((DRY_RUN || capability >= 89)); then
    bench "training throughput, 1.3b/4096 fp8 compiled, o_proj in bf16" 240 tools/bench/throughput.py model=1.3b \
      model.seq_length=4096 precision=fp8 'precision.skip=[output,*o_proj]' trainer.compile=true \
      trainer.global_batch_size=2 trainer.micro_batch_size=2 --steps 6 --warmup 3 --profile 2
  fi
  # megalm's fastest single-GPU step as pretraining runs it: every speed option (fused weight gradients, opt-in; the
  # one-pass Triton AdamW, auto's since 2026-12-05) and 4 micro-batches of 2 sequences a step, so that the optimizer
  # step (24 of the 173 ms of one micro-batch's step on 2026-11-29) is shared as gradient accumulation shares it: the
  # MFU the fast step's 55% goal is about
  bench "training throughput, 1.3b/4096 bf16 with every speed option, 4 micro-batches a step (compiled)" 240 \
    tools/bench/throughput.py model=1.3b model.seq_length=4096 precision=bf16 trainer.compile=true \
    parallel.gradient_accumulation_fusion=true optim.implementation=triton trainer.global_batch_size=8 \
    trainer.micro_batch_size=2 --steps 4 --warmup 2 --profile 1
  # eager fp8 (the throughput step's compiled fp8 rows are the ones its goal is about): host-bound on 2026-11-29
  # (4,124 kernels, 15.5% idle), since 2026-12-03 on bf16 working weights
  if ((DRY_RUN || capability >= 89)); then
    bench "training throughput, 1.3b/4096 fp8 (torch._scaled_mm)" 150 tools/bench/throughput.py model=1.3b \
      model.seq_length=4096 precision=fp8 trainer.compile=false trainer.global_batch_size=2 trainer.micro_batch_size=2 \
      --steps 6 --warmup 2 --profile 2
    # Triton's kernels of a 1.3B block, bf16 against fp8_delayed: the CPU's trace has the FP8 backward re-reading the
    # fused projections' gradients for each cast (a concatenation no cast fuses into: ~13 GB a step, 2026-12-03),
    # which Triton's scheduler may decide otherwise (docs/benchmarks.md, "Delayed scaling's casts")
    bench "inductor's kernels, a 1.3b block at 4,096 tokens, bf16 and fp8_delayed" 180 \
      tools/bench/inductor_kernels.py model=1.3b model.seq_length=4096 model.num_layers=2 \
      trainer.global_batch_size=1 trainer.micro_batch_size=1 --precisions bf16 fp8_delayed --top 8
  fi
  # Mixture of experts on one GPU (the grouped GEMMs' speed): moe_1b's 16 experts at 8 of its 24 layers (2.5B
  # parameters, 0.5B active: its 18 bytes per parameter fit one H100); eager, then compiled: its blocks are whole
  # graphs since 2026-11-30
  bench "training throughput, moe_1b (8 layers)/2048 bf16" 150 tools/bench/throughput.py model=moe_1b \
    model.num_layers=8 precision=bf16 trainer.compile=false trainer.global_batch_size=4 trainer.micro_batch_size=4 \
    --steps 6 --warmup 2
  bench "training throughput, moe_1b (8 layers)/2048 bf16 compiled" 240 tools/bench/throughput.py model=moe_1b \
    model.num_layers=8 precision=bf16 trainer.compile=true trainer.global_batch_size=4 trainer.micro_batch_size=4 \
    --steps 6 --warmup 3
  # the zero-bubble schedule's blocks, eager and compiled (one GPU runs no pipeline, so the tool times a
  # micro-batch's forward, B and W by hand), beside compiled 1F1B blocks
  bench "zero-bubble blocks, 1.3b (8 layers)/4096 bf16" 300 tools/bench/zero_bubble_blocks.py model=1.3b \
    model.seq_length=4096 model.num_layers=8 --seqs 2 --iters 5 --warmup 2
  # then the benchmarks measured on 2026-11-28
  bench "MX quantization bandwidth (Triton kernel vs PyTorch reference)" 120 \
    tools/bench/mx_quantize_bandwidth.py --m 8192 --k 8192 --iters 10 --warmup 2
  bench "training throughput, 125m bf16 (the default: compiled on CUDA)" 120 tools/bench/throughput.py model=125m \
    precision=bf16 trainer.global_batch_size=8 trainer.micro_batch_size=8 --steps 10 --warmup 3
  bench "precision recipes on the demo, 100 steps" 180 tools/bench/precision_convergence.py \
    --recipes fp32 bf16 fp8 mxfp4 --steps 100 trainer.eval_iters=4
  if ((DRY_RUN || gpus > 1)); then  # one GPU per CP rank: on one GPU there is nothing to compare
    bench "context parallelism, cp up to $((gpus < 4 ? gpus : 4))" 150 tools/bench/context_parallel.py \
      --nproc "$((gpus < 4 ? gpus : 4))" --seq 4096 8192 --steps 3 --warmup 1 model=125m precision=bf16
  else
    report "" "### context parallelism: not run (one GPU: one GPU per CP rank)"
  fi
  # the attention kernels last (measured on 2026-11-29 and 2026-12-05; the throughput step had them first, until it
  # needed their minute for the rows that decide defaults): cuDNN's kernel (auto's pick on Hopper for equal
  # documents) against torch's flash one
  bench "attention kernels, 1.3b/4096, one document per sequence" 90 tools/bench/attention_kernels.py model=1.3b \
    model.seq_length=4096 --seqs 4
  # unequal documents, as packed pretraining data and throughput.py's rows have them (a new layout each of the 26
  # calls, as each micro-batch is): torch's flash varlen kernel, 35 of the compiled bf16 step's 176 ms on 2026-11-29
  # (cuDNN's kernel on the same packed documents, which torch's varlen function keeps off: last)
  bench "attention kernels, 1.3b/4096, unequal documents" 90 tools/bench/attention_kernels.py model=1.3b \
    model.seq_length=4096 --seqs 2 --ragged --layouts 26
  # last, each in a process of its own (torch 2.11's backward of this op may fault, which ends only its process):
  # cuDNN's kernel on the packed unequal documents, forward alone, then forward and backward, then bucketed shapes
  bench "attention kernels, unequal documents, cuDNN ragged (forward)" 60 tools/bench/attention_kernels.py \
    model=1.3b model.seq_length=4096 --seqs 2 --ragged --layouts 26 --backends torch_varlen,cudnn_ragged \
    --forward-only
  bench "attention kernels, unequal documents, cuDNN ragged" 60 tools/bench/attention_kernels.py model=1.3b \
    model.seq_length=4096 --seqs 2 --ragged --layouts 26 --backends torch_varlen,cudnn_ragged
  bench "attention kernels, unequal documents, cuDNN ragged bucketed" 60 tools/bench/attention_kernels.py \
    model=1.3b model.seq_length=4096 --seqs 2 --ragged --layouts 26 --backends torch_varlen,cudnn_ragged_bucketed
}

# ---------------------------------------------------------------------------------------------------- compare
peers_ok=
install_peers() {  # once, for either compare step
  [ -n "$peers_ok" ] && return
  peers_ok=1
  if ((!DRY_RUN)); then  # the peers go into a folder of their own, not into the image's site-packages
    if ls "$PEER_WHEELS"/*.whl >/dev/null 2>&1 && "$PYTHON" -m pip install -q --no-index --no-deps \
        --target "$WORK/site" "$PEER_WHEELS"/*.whl >>"$LOG" 2>&1; then
      export PYTHONPATH="$PYTHONPATH:$WORK/site"
    else
      peers_ok=0
      report "" "### compare: the peers' wheels are missing from $PEER_WHEELS/ or do not install" \
        "(tools/gpu_check.sh --print-run); megalm alone is measured"
    fi
  fi
}
step_compare() {
  install_peers
  if ((DRY_RUN)); then
    run "megalm vs Megatron-Core vs TorchTitan (dry run: tiny, CPU, megalm only)" 120 "$PYTHON" \
      tools/bench/compare.py --tiny --precisions fp32 --steps 1 --warmup 0 --repeats 1 --frameworks megalm \
      --profile 1 --json "$OUT_DIR/compare_dry_run.json"
  elif ((peers_ok)); then
    # the fast step's shape (1.3B, seq 4096): the 125m cells of the default grid were measured on 2026-11-28; each
    # row's kernel ms per kind (--profile 2) say what TorchTitan's step spends less on than megalm's
    run "megalm vs Megatron-Core vs TorchTitan, 1.3b/4096" 540 "$PYTHON" tools/bench/compare.py --shapes 1.3b \
      --profile 2 --json "$OUT_DIR/compare.json"
  else
    run "megalm alone (no peers), 1.3b/4096" 300 "$PYTHON" tools/bench/compare.py --shapes 1.3b --frameworks megalm \
      --profile 2 --json "$OUT_DIR/compare.json"
  fi
}
# The 55% goal's cell as pretraining steps it: bf16, 4 micro-batches of 16,384 tokens a step in every framework (the
# optimizer step shared by them), megalm compiled with its speed options (fused weight gradients, opt-in; the Triton
# AdamW, auto's on CUDA since 2026-12-05); one repeat, profiled.
step_compare_accumulated() {
  install_peers
  local accumulated=(--tokens-per-step 65536 --micro-batches 4 --repeats 1 --profile 1
                     parallel.gradient_accumulation_fusion=true optim.implementation=triton)
  if ((DRY_RUN)); then
    run "megalm vs its peers, 4 micro-batches a step (dry run: tiny, CPU, megalm only)" 120 "$PYTHON" \
      tools/bench/compare.py --tiny --precisions bf16 --seqs 64 --steps 1 --warmup 0 --frameworks megalm \
      "${accumulated[@]}" --tokens-per-step 1024 --json "$OUT_DIR/compare_accumulated_dry_run.json"
  else
    local peers=",torchtitan,megatron"
    ((peers_ok)) || peers=""
    run "megalm vs Megatron-Core vs TorchTitan, 1.3b/4096 bf16, 4 micro-batches a step" 420 "$PYTHON" \
      tools/bench/compare.py --shapes 1.3b --precisions bf16 --frameworks "megalm_compiled$peers" \
      "${accumulated[@]}" --json "$OUT_DIR/compare_accumulated.json"
  fi
}

# ------------------------------------------------------------------------------ the steps, in the order asked
for step in "${STEPS[@]}"; do
  case "$step" in
    throughput) step_throughput ;;
    tests) step_tests ;;
    calibrate) step_calibrate ;;
    bench) step_bench ;;
    compare) step_compare ;;
    compare_accumulated) step_compare_accumulated ;;
  esac
done

# ---------------------------------------------------------------------------------------------------- verdict
total=$((SECONDS - start))
if ((${#failures[@]})); then
  report "" "**FAIL** after $total s: ${failures[*]}"
  say "FAIL (${failures[*]}); report $REPORT, full output $LOG"
  exit 1
fi
report "" "**PASS** after $total s$( ((DRY_RUN)) && echo ' (dry run)')"
say "PASS$( ((DRY_RUN)) && echo ' (dry run)'); report $REPORT, full output $LOG"
exit 0
