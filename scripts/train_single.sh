#!/usr/bin/env bash
# One process (CPU or one GPU). Any Hydra override may follow, e.g.:
#   scripts/train_single.sh model=125m precision=bf16 trainer.max_steps=1000
set -euo pipefail
exec python -m megalm.train "$@"
