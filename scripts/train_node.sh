#!/usr/bin/env bash
# One node, N processes (GPUs, or CPU processes with gloo). Hydra overrides follow, e.g.:
#   NPROC=8 scripts/train_node.sh model=1.3b precision=bf16 parallel.tp=2 trainer.micro_batch_size=3
#   NPROC=2 scripts/train_node.sh trainer.device=cpu parallel.tp=2      # CPU, gloo (tp ranks share the batch)
# parallel.dp defaults to NPROC / (tp * pp * cp).
set -euo pipefail
# GPUs this node gives the run (CUDA_VISIBLE_DEVICES when set; MIG slices are not GPUs), at least 1 (CPU processes)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
# set, even empty (no GPU visible: CPU processes)
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c . || true); fi
NPROC=${NPROC:-$(( gpus > 0 ? gpus : 1 ))}
exec torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC" -m megalm.train "$@"
