#!/usr/bin/env bash
# One node, N processes (GPUs, or CPU processes with gloo). Hydra overrides follow, e.g.:
#   NPROC=8 scripts/train_node.sh model=1.3b precision=bf16 parallel.tp=2 trainer.micro_batch_size=3
#   NPROC=2 scripts/train_node.sh trainer.device=cpu parallel.tp=2      # CPU, gloo (tp ranks share the batch)
# parallel.dp defaults to NPROC / (tp * pp * cp).
set -euo pipefail
# shellcheck source=scripts/node_processes.sh
source "$(dirname "${BASH_SOURCE[0]}")/node_processes.sh"
NPROC=${NPROC:-$(node_processes)}
exec torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" -m megalm.train "$@"
