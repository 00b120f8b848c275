#!/usr/bin/env bash
# Several nodes: run this once on every node. The rendezvous endpoint comes from the environment:
#   MASTER_ADDR   host of the rendezvous (node 0), MASTER_PORT (default 29500)
#   NNODES        number of nodes, NPROC_PER_NODE (default: GPUs on this node)
#   NODE_RANK     optional; with the c10d rendezvous torchrun assigns ranks itself
#   RUN_ID        optional job id shared by all nodes (default megalm)
# Example (2 nodes x 8 GPUs):
#   MASTER_ADDR=node0 NNODES=2 scripts/train_multinode.sh model=7b precision=bf16 parallel.tp=8
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host}"
: "${NNODES:?set NNODES to the number of nodes}"
MASTER_PORT=${MASTER_PORT:-29500}
# shellcheck source=scripts/node_processes.sh
source "$(dirname "${BASH_SOURCE[0]}")/node_processes.sh"
NPROC_PER_NODE=${NPROC_PER_NODE:-$(node_processes)}
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RUN_ID:-megalm}" \
    ${NODE_RANK:+--node-rank "$NODE_RANK"} -m megalm.train "$@"
