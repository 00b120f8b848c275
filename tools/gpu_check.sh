#!/usr/bin/env bash
# The GPU tier in one command, on a machine with a CUDA GPU (docs/benchmarks.md, "The GPU tier"):
#   1. refuses, exit 2, when no CUDA device is visible (nothing is installed or run then);
#   2. installs what the machine lacks: hydra-core, omegaconf, pytest-timeout from the git-ignored wheels
#      folder (.wheels/, filled by tools/gpu_wheels.sh where pip reaches an index; no network needed here),
#      then megalm itself (pip install --no-deps -e .);
#   3. runs the GPU tests: tests/gpu (marker gpu), and the unit test files that take their CUDA paths when a GPU
#      is visible: the MX GEMMs through the Triton quantizer (test_mx_gemm_fused.py), the compiled Triton MX
#      kernel (test_mx_triton.py) and the ring's memory-efficient block kernel (test_ring_kernels.py);
#   4. runs the quick GPU benchmarks of tools/bench with small settings, within a time budget;
#   5. writes a markdown report (date, device, versions, test counts, benchmark lines) to $OUT (a file, or a
#      folder to write gpu_check_report.md into; default ./gpu_check_report.md), the full output beside it.
# Exit 0 when every test passed and every benchmark ran; 1 when a test failed, none ran, or a benchmark
# failed; 2 without CUDA; 3 when the dependencies cannot be installed.
# Environment: PYTHON (default python3), WHEELS (default .wheels), OUT, GPU_CHECK_BUDGET_S (default 540: the
# benchmarks that would start after it are skipped, so the whole run stays under ten minutes on one H100).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.wheels}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
TEST_TIMEOUT_S=420

# ------------------------------------------------------------------------------------------ 1. a CUDA GPU
if ! "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
  echo "gpu_check: $PYTHON cannot import torch; install a CUDA build of PyTorch (or set PYTHON=...)." >&2
  exit 2
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is False for $PYTHON); the GPU tier needs" \
       "one, so nothing was run. On a CPU machine run the default suite: pytest" >&2
  exit 2
fi

REPORT=${OUT:-gpu_check_report.md}
[ -d "$REPORT" ] && REPORT="$REPORT/gpu_check_report.md"
mkdir -p "$(dirname "$REPORT")"
LOG="${REPORT%.md}.log"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: >"$LOG"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # megalm importable even if the editable install fails
unset TRITON_INTERPRET  # the MX kernel's tests must run compiled on the GPU, not in Triton's interpreter
start=$SECONDS
say() { echo "gpu_check: $*" | tee -a "$LOG"; }

# ---------------------------------------------------------------------------------------- 2. dependencies
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
if [ -n "$absent" ]; then
  echo "gpu_check: $PYTHON lacks $absent, which megalm or its GPU tests need and $WHEELS/ does not carry;" \
       "install them (pip install $absent) and run again." >&2
  exit 3
fi
if [ -n "$missing" ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PYTHON lacks $missing and $WHEELS/ holds no wheels; run tools/gpu_wheels.sh where pip" \
         "reaches an index and bring $WHEELS/ along (or pip install $missing)." >&2
    exit 3
  fi
  say "installing $missing from $WHEELS/"
  # shellcheck disable=SC2086  # one word per package
  if ! "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" $missing >>"$LOG" 2>&1; then
    echo "gpu_check: pip could not install $missing from $WHEELS/ (see $LOG)" >&2
    exit 3
  fi
fi
install_note="megalm installed editable (pip install --no-deps -e .)"
if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
  install_note="pip install -e . failed (see the log); megalm imported from $ROOT through PYTHONPATH"
fi
say "$install_note"

# --------------------------------------------------------------------------------------------- 3. tests
TESTS=(tests/gpu tests/unit/test_mx_gemm_fused.py tests/unit/test_mx_triton.py tests/unit/test_ring_kernels.py)
# `-m "gpu or not slow"`: the gpu tests, and the unit files' tests, which carry no marker (on a CPU machine they
# run in the default suite: the Triton kernels under its interpreter, the CUDA-only tests skipped)
TEST_CMD=("$PYTHON" -m pytest -m "gpu or not slow" "${TESTS[@]}" -p no:cacheprovider -rfEs
          --junitxml="$WORK/junit.xml")
TEST_SHOWN="$PYTHON -m pytest -m \"gpu or not slow\" ${TESTS[*]}"
say "tests: $TEST_SHOWN"
t0=$SECONDS
timeout "$TEST_TIMEOUT_S" "${TEST_CMD[@]}" 2>&1 | tee -a "$LOG"
test_rc=${PIPESTATUS[0]}
test_s=$((SECONDS - t0))

# ----------------------------------------------------------------------------------------- 4. benchmarks
capability=$("$PYTHON" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
cp_ranks=$((gpus < 4 ? gpus : 4))  # one GPU per CP rank: cp = 1 (the baseline) only, on one GPU
: >"$WORK/bench.tsv"
bench() {  # bench NAME TIMEOUT_S SCRIPT ARGS...: run one benchmark within what is left of the budget
  local name=$1 limit=$2 i left status rc t0
  shift 2
  i=$(($(wc -l <"$WORK/bench.tsv")))
  left=$((BUDGET_S - (SECONDS - start)))
  if ((left < 30)); then
    say "benchmark $name: skipped (the ${BUDGET_S} s budget is spent)"
    printf '%s\t%s\tskipped\t-\t0\t%s\n' "$i" "$name" "$*" >>"$WORK/bench.tsv"
    return
  fi
  ((limit > left)) && limit=$left
  say "benchmark $name: $PYTHON $* (at most $limit s)"
  t0=$SECONDS
  timeout "$limit" "$PYTHON" "$@" 2>&1 | tee "$WORK/bench$i.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  status=$([ "$rc" -eq 0 ] && echo ok || { [ "$rc" -eq 124 ] && echo "timed out" || echo failed; })
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$i" "$name" "$status" "$rc" "$((SECONDS - t0))" "$*" >>"$WORK/bench.tsv"
}
bench "MX quantization bandwidth (Triton kernel vs PyTorch reference)" 240 \
  tools/bench/mx_quantize_bandwidth.py --m 8192 --k 8192 --iters 10 --warmup 2
bench "training throughput, 125m bf16" 180 \
  tools/bench/throughput.py model=125m precision=bf16 trainer.global_batch_size=8 trainer.micro_batch_size=8 \
  --steps 10 --warmup 3
if ((capability >= 89)); then
  bench "training throughput, 125m fp8 (torch._scaled_mm)" 180 \
    tools/bench/throughput.py model=125m precision=fp8 trainer.global_batch_size=8 trainer.micro_batch_size=8 \
    --steps 10 --warmup 3
fi
bench "precision recipes on the demo, 100 steps" 240 \
  tools/bench/precision_convergence.py --recipes fp32 bf16 fp8 mxfp4 --steps 100 trainer.eval_iters=4
bench "context parallelism, cp up to $cp_ranks (one GPU per rank)" 180 \
  tools/bench/context_parallel.py --nproc "$cp_ranks" --seq 4096 8192 --steps 3 --warmup 1 model=125m precision=bf16

# ----------------------------------------------------------------------------------------------- 5. report
"$PYTHON" - "$REPORT" "$WORK" "$test_rc" "$test_s" "$((SECONDS - start))" "$install_note" "$TEST_SHOWN" \
  <<'EOF' | tee -a "$LOG"
"""Write the markdown report from the junit XML and the benchmark logs; print the verdict; exit 0 or 1."""
import datetime, platform, subprocess, sys, xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import torch

report, work, test_rc, test_s, total_s, install_note, test_cmd = sys.argv[1:]
work, test_rc = Path(work), int(test_rc)

def version(module):
    try:
        return __import__(module).__version__
    except Exception:
        return "not installed"

def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return ""

props = torch.cuda.get_device_properties(0)
driver = sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").splitlines()[:1]
commit = sh("git", "describe", "--always", "--dirty") or "unknown (no git checkout)"
counts, failed, skips = Counter(), [], Counter()
junit = work / "junit.xml"
if junit.exists():
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts[outcome] += 1
        if outcome in ("failure", "error"):
            failed.append(f"{name} ({outcome})")
        elif outcome == "skipped":
            skips[next(c for c in case if c.tag == "skipped").get("message", "")[:160]] += 1
tests_ok = test_rc == 0 and counts["passed"] > 0 and not failed
benches = [line.rstrip("\n").split("\t") for line in (work / "bench.tsv").read_text().splitlines()]
bench_failed = [b[1] for b in benches if b[2] not in ("ok", "skipped")]
ok = tests_ok and not bench_failed
why = [] if ok else ([f"tests (pytest exit {test_rc})"] if not tests_ok else []) + bench_failed

lines = [
    "# megalm GPU check", "",
    f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {total_s} s in all",
    f"- device: {torch.cuda.get_device_name(0)} (sm{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB), "
    f"{torch.cuda.device_count()} visible" + (f"; driver {driver[0]}" if driver else ""),
    f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {version('triton')}, "
    f"flash-attn {version('flash_attn')}, Python {platform.python_version()}",
    f"- commit: {commit}; {install_note}",
    f"- result: **{'PASS' if ok else 'FAIL'}**" + (f" ({', '.join(why)})" if why else ""),
    "", "## Tests", "", f"`{test_cmd}`", "",
    f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, {counts['skipped']} skipped "
    f"in {test_s} s (pytest exit code {test_rc}" + (", timed out" if test_rc == 124 else "") + ")",
]
if failed:
    lines += ["", "Failed:", *[f"- `{name}`" for name in failed]]
if skips:
    lines += ["", "Skipped:", *[f"- {n} × {reason}" for reason, n in skips.most_common()]]
lines += ["", "## Benchmarks"]
for i, name, status, rc, seconds, command in benches:
    lines += ["", f"### {name}: {status}" + (f" (exit {rc})" if status not in ("ok", "skipped") else "")
              + (f", {seconds} s" if status != "skipped" else ""), "", f"`python {command}`"]
    log = work / f"bench{i}.log"
    if log.exists():
        tail = [line for line in log.read_text().splitlines() if line.strip()][-24:]
        lines += ["", "```", *tail, "```"] if tail else ["", "(no output)"]
Path(report).write_text("\n".join(lines) + "\n")
print(f"gpu_check: {'PASS' if ok else 'FAIL'}" + (f" ({', '.join(why)})" if why else "")
      + f"; report {report}, full output {report.removesuffix('.md')}.log")
sys.exit(0 if ok else 1)
EOF
exit "${PIPESTATUS[0]}"
