# shellcheck shell=bash
# Sourced by train_node.sh and train_multinode.sh: `node_processes` prints how many processes this node runs, one
# per GPU it gives the run (CUDA_VISIBLE_DEVICES when set, even empty: no GPU visible; MIG slices are not GPUs), at
# least 1 (CPU processes on gloo).
node_processes() {
    local gpus
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    fi
    echo $(( gpus > 0 ? gpus : 1 ))
}
