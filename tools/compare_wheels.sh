#!/usr/bin/env bash
# Fill a wheels folder with what tools/bench/compare.py needs on a GPU machine without network access, for its
# Python (3.12, x86-64, CUDA PyTorch 2.11 already there): megalm's own pure-Python needs (tools/gpu_wheels.sh),
# then every pin of tools/compare_peers.txt (Megatron-Core, TorchTitan and the packages its llama3 imports that
# the image lacks, torchao for TorchTitan's fp8), the one place their versions are set.
# Run it where pip reaches an index:
#     tools/compare_wheels.sh        # -> .whl/ (git-ignored; WHEELS=DIR for another folder)
# then carry the folder and install from it there before the benchmark:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-python3}
WHEELS="$WHEELS" PYTHON="$PYTHON" tools/gpu_wheels.sh >/dev/null  # empties the folder first, then megalm's needs
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# --no-deps: the pins name every package the image lacks, and nothing may bring another torch.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$WHEELS" -r tools/compare_peers.txt
ls -1 "$WHEELS"
du -sh "$WHEELS"
