#!/usr/bin/env bash
# One extra torch leg of .ci/run: a venv with torch==VERSION (the PyPI wheel: a CUDA build, which runs on CPU and
# makes fake CUDA tensors), megalm and its dev extra, then the unit subset of .ci/torch_leg_tests.txt (the fake-CUDA
# tier included). PEERS=1 also installs tools/compare_peers.txt and runs the peers of tools/bench/compare.py at their
# pins. Exit code 5 (no tests) is a failure.
#     bash .ci/torch_leg.sh 2.11.0                 install into a temporary venv, then test (by hand)
#     bash .ci/torch_leg.sh install 2.11.0 DIR     only install, into DIR/venv (.ci/run does this in the background,
#                                                  while the long tests run: a cold download of torch is minutes of
#                                                  waiting on the network, not of CPU)
#     bash .ci/torch_leg.sh test 2.11.0 DIR        only test, in DIR/venv as `install` left it
# Prints the install time, the pass count and the test time.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  install|test) PHASE=$1; VERSION=$2; DIR=$3 ;;
  *) PHASE=both; VERSION=$1; DIR=$(mktemp -d); trap 'rm -rf "$DIR"' EXIT ;;
esac
VENV=$DIR/venv

install() {
  local t0=$SECONDS
  mkdir -p "$DIR"
  python -m venv "$VENV"
  # pip's bytecode compilation (about half of the install's CPU) stays: with PYTHONDONTWRITEBYTECODE=1, as on these
  # machines, an import writes no .pyc, and every process of the leg would compile torch again (17 s of CPU an
  # `import torch` without them, 7 s with, 2026-12-01)
  "$VENV/bin/python" -m pip install -q "torch==$VERSION"
  # megalm and the peers in one resolve: installed one after the other, the peers' pins could downgrade what megalm's
  # extras had brought (2026-12-03: datasets 4.7's huggingface-hub<2 took hub back to 1.33 under transformers 5.25,
  # which needs >=2.4, and transformers failed at import); together pip picks versions that agree (transformers 5.24)
  local peers=()
  if [ "${PEERS:-0}" = 1 ]; then peers=(-r tools/compare_peers.txt); fi
  "$VENV/bin/python" -m pip install -q -e ".[dev]" "${peers[@]}" -c <(echo "torch==$VERSION")  # keep this torch
  # a venv whose requirements disagree fails here, in one line, not as import errors across the tests
  "$VENV/bin/python" -m pip check >/dev/null || { "$VENV/bin/python" -m pip check; echo "torch leg $VERSION: broken requirements (above)"; exit 1; }
  local installed
  installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')
  [[ "$installed" == "${VERSION%\*}"* ]] || { echo "torch leg $VERSION: the venv has torch $installed"; exit 1; }
  echo "torch leg $VERSION ($installed): install $((SECONDS - t0)) s" | tee "$DIR/installed"
}

run_tests() {
  [ -f "$DIR/installed" ] || { echo "torch leg $VERSION: nothing installed in $DIR (run: $0 install $VERSION $DIR)"; exit 1; }
  local tests t1=$SECONDS rc summary
  mapfile -t tests < <(grep -v '^\s*#' .ci/torch_leg_tests.txt | grep -v '^\s*$')
  if [ "${PEERS:-0}" = 1 ]; then
    tests+=(tests/unit/test_compare_peers.py tests/unit/test_bench_compare.py)
  fi
  set +e
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile "${tests[@]}" 2>&1 \
    | tee "$DIR/pytest.log"
  rc=${PIPESTATUS[0]}
  set -e
  summary=$(grep -E '^=*\s*[0-9]+ (passed|failed|errors?)' "$DIR/pytest.log" | tail -1 | tr -d '=' | xargs || true)
  echo "$(cat "$DIR/installed"); ${summary:-no summary} (tests ${#tests[@]} files, $((SECONDS - t1)) s)"
  return "$rc"
}

case $PHASE in
  install) install ;;
  test) run_tests ;;
  both) install && run_tests ;;
esac
