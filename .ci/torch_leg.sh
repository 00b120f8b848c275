#!/usr/bin/env bash
# One extra torch leg of .ci/run: a fresh venv with torch==VERSION (the PyPI wheel: a CUDA build, which runs on
# CPU and makes fake CUDA tensors), megalm and its dev extra, then the unit subset of .ci/torch_leg_tests.txt
# (the fake-CUDA tier included). PEERS=1 also installs tools/compare_peers.txt and builds the peers of
# tools/bench/compare.py at their pins. Prints the leg's install time, pass count and test time; exit code 5
# (no tests) is a failure. Budget: ten minutes with the install (a cold download of torch is most of it).
#     bash .ci/torch_leg.sh 2.11.0 [PEERS=1 in the environment]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$1
VENV=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$VENV")"' EXIT
t0=$SECONDS
python -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "torch==$VERSION"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
if [ "${PEERS:-0}" = 1 ]; then
  "$VENV/bin/python" -m pip install -q -r tools/compare_peers.txt -c <(echo "torch==$VERSION")  # keep this torch
fi
installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')
install_s=$((SECONDS - t0))
mapfile -t tests < <(grep -v '^\s*#' .ci/torch_leg_tests.txt | grep -v '^\s*$')
if [ "${PEERS:-0}" = 1 ]; then
  tests+=(tests/unit/test_compare_peers.py tests/unit/test_bench_compare.py)
fi
t1=$SECONDS
set +e
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile "${tests[@]}" 2>&1 | tee "$(dirname "$VENV")/pytest.log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E '^=*\s*[0-9]+ (passed|failed|errors?)' "$(dirname "$VENV")/pytest.log" | tail -1 | tr -d '=' | xargs \
  || true)
echo "torch leg $VERSION ($installed): install ${install_s} s; ${summary:-no summary} (tests ${#tests[@]} files, $((SECONDS - t1)) s); leg $((SECONDS - t0)) s"
exit "$rc"
