#!/usr/bin/env bash
# Fill the wheels folder that tools/gpu_check.sh installs from on a GPU machine without network access:
# megalm's pure-Python dependencies that a CUDA image with PyTorch lacks (hydra-core, omegaconf and its
# antlr4 runtime, pytest-timeout; pytest-xdist, optional), as py3-none-any wheels that install on any Python >= 3.10, and torchao. antlr4's 4.9
# release is a source archive only, so `pip wheel` builds its wheel here. Run it where pip reaches an index:
#     tools/gpu_wheels.sh            # -> .wheels/ (git-ignored; WHEELS=DIR for another folder)
# then bring the folder along with the checkout, and run tools/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.wheels}
PYTHON=${PYTHON:-python3}
mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl  # one version of each: pip must not choose between stale ones
# The versions megalm's pyproject.toml asks for, and what hydra-core 1.3 itself pins (omegaconf < 2.4, antlr4 4.9).
"$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" \
  "antlr4-python3-runtime==4.9.*" "pytest-timeout>=2"
# Optional: pytest-xdist and its execnet, so that gpu_check.sh's tests step runs its workers side by side.
"$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" "pytest-xdist>=3" "execnet>=2"
# Optional: torchao, for precision.backend=torchao (its GPU test skips without it), at the version
# tools/compare_peers.txt pins; a cp310-abi3 wheel (any CPython >= 3.10 on x86-64 Linux), as the GPU image needs.
torchao=$(sed -n 's/^\(torchao==[0-9.]*\).*/\1/p' tools/compare_peers.txt)
if [ -z "$torchao" ] || ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$WHEELS" "$torchao"; then
  echo "gpu_wheels: no torchao wheel (${torchao:-no torchao pin in tools/compare_peers.txt}); its GPU test will skip" >&2
fi
ls -1 "$WHEELS"
