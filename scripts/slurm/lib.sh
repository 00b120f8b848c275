# shellcheck shell=bash disable=SC2034  # LOG_DIR, NPROC: set here, used by the templates sourcing this
# Sourced by scripts/slurm/train.sbatch and train_single_node.sbatch: the run dir, per-node logs, the
# preemption signal path and the requeue-on-exit-75 rule, written once. Not a job script of its own.
#
# Contract with megalm (megalm/train.py): on SIGTERM or SIGUSR1 every training process finishes its step,
# writes a checkpoint and exits with 75 (EX_TEMPFAIL, "requeue me"). torchrun turns any failing worker into
# its own exit status 1, so megalm also touches $MEGALM_REQUEUE_MARKER.rank<R>-of-<W> when it exits 75, and
# .failed-rank<R> when it fails on its own; the job is requeued when srun exits 75, or when a process asked and none
# failed. Anything else passes through as is.

EX_TEMPFAIL=75

megalm_log() { echo "[megalm-slurm $(date +%H:%M:%S)] $*" >&2; }

# The checkout: sbatch runs a *copy* of the batch script from slurmd's spool dir, so "$0" cannot locate the
# repo; jobs are submitted from the checkout (or MEGALM_ROOT names it).
MEGALM_ROOT=${MEGALM_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
if [[ ! -f "$MEGALM_ROOT/megalm/train.py" ]]; then
    megalm_log "error: $MEGALM_ROOT is not a megalm checkout; submit from it or set MEGALM_ROOT"
    exit 2
fi
# torchrun -m megalm.train imports this checkout even where it is not pip-installed
export PYTHONPATH="$MEGALM_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The Python environment of the training processes. Without a knob, the one sbatch was called from (sbatch exports
# it to the job). MEGALM_VENV=/path/to/venv: activated here, so srun's tasks on every node inherit it (the path
# must exist on the nodes). MEGALM_LAUNCH: words put before torchrun on every node, for a container, e.g.
# MEGALM_LAUNCH="apptainer exec --nv --bind $MEGALM_ROOT /images/train.sif" (the checkout visible inside). Its words
# are split at spaces, quotes and all: a path in it may not hold a space (bind a link to it instead).
if [[ -n "${MEGALM_VENV:-}" ]]; then
    if [[ ! -f "$MEGALM_VENV/bin/activate" ]]; then
        megalm_log "error: MEGALM_VENV=$MEGALM_VENV has no bin/activate; point it at a virtualenv or unset it"
        exit 2
    fi
    # shellcheck source=/dev/null
    source "$MEGALM_VENV/bin/activate"
fi
read -r -a MEGALM_LAUNCH_WORDS <<<"${MEGALM_LAUNCH:-}"
if [[ ${#MEGALM_LAUNCH_WORDS[@]} -eq 0 ]] && ! command -v torchrun >/dev/null; then
    megalm_log "error: torchrun is not on PATH; export MEGALM_VENV=/path/to/venv (or activate it) before sbatch," \
        "or MEGALM_LAUNCH='apptainer exec --nv IMAGE' for a container"
    exit 2
fi

# The run dir is a function of the job, not of the clock (Hydra's default): a requeued job keeps its
# SLURM_JOB_ID, lands in the same dir, and trainer.resume=auto (the default) continues from its checkpoint.
# A hydra.run.dir=... among the overrides wins (++hydra.run.dir= too; Hydra refuses +hydra.run.dir=, the key exists).
MEGALM_RUN_DIR_ARG='^\+{0,2}hydra\.run\.dir='  # an override that sets it, as a regex

megalm_sets_run_dir() {
    local arg
    for arg in "$@"; do
        [[ "$arg" =~ $MEGALM_RUN_DIR_ARG ]] && return 0
    done
    return 1
}

megalm_run_dir() {
    local arg submit=${SLURM_SUBMIT_DIR:-$PWD}
    local dir="outputs/${SLURM_JOB_NAME:-megalm}-${SLURM_JOB_ID:?not inside a Slurm job}"
    for arg in "$@"; do
        [[ "$arg" =~ $MEGALM_RUN_DIR_ARG ]] && dir=$(megalm_unquote "${arg#*hydra.run.dir=}")
    done
    [[ "$dir" == /* ]] || dir="$submit/$dir"  # relative to the submit dir, the job's working dir
    echo "$dir"
}

# A value as Hydra's override grammar reads it: in quotes ('...' or "..."), a run of 2k backslashes before a quote or
# at the end is k, and 2k + 1 before a quote is k and the quote itself (megalm_run_dir_override's inverse); else as is;
# then as OmegaConf reads it (megalm_unescape_interpolations).
megalm_unquote() {
    local value=$1 quote=${1:0:1} out="" run=0 i c
    if (( ${#value} < 2 )) || [[ ( "$quote" != "'" && "$quote" != '"' ) || "${value: -1}" != "$quote" ]]; then
        megalm_unescape_interpolations "$value"
        return
    fi
    value=${value:1:${#value}-2}
    for ((i = 0; i < ${#value}; i++)); do
        c=${value:i:1}
        if [[ "$c" == "\\" ]]; then
            run=$((run + 1))
            continue
        fi
        [[ "$c" == "$quote" ]] && run=$((run / 2))
        for ((; run > 0; run--)); do out+="\\"; done
        out+=$c
    done
    for ((run /= 2; run > 0; run--)); do out+="\\"; done
    megalm_unescape_interpolations "$out"
}

# VALUE as OmegaConf reads it: a run of n backslashes before '${' is n / 2 (rounded down; odd, the '${' is literal,
# an escaped interpolation), other backslashes as they are (megalm_run_dir_override's escape's inverse).
megalm_unescape_interpolations() {
    local value=$1 out="" run=0 i c
    for ((i = 0; i < ${#value}; i++)); do
        c=${value:i:1}
        if [[ "$c" == "\\" ]]; then
            run=$((run + 1))
            continue
        fi
        [[ "$c" == '$' && "${value:i+1:1}" == '{' ]] && run=$((run / 2))
        for ((; run > 0; run--)); do out+="\\"; done
        out+=$c
    done
    for ((; run > 0; run--)); do out+="\\"; done
    printf '%s\n' "$out"
}

# The hydra.run.dir=... override of DIR, quoted for Hydra's override grammar: a job name may hold what the grammar
# reads otherwise unquoted (a comma is a sweep; parentheses, '=', '[', '#' do not parse), and what OmegaConf would
# resolve (a '${' starts an interpolation: escaped, a run of n backslashes before it made 2n + 1).
megalm_run_dir_override() {  # in quotes, a run of backslashes before a quote or at the end is doubled, a quote escaped
    printf "hydra.run.dir='%s'" "$(printf '%s' "$1" | sed -E 's/(\\*)\$\{/\1\1\\${/g' |
        sed -E "s/(\\\\+)('|\$)/\\1\\1\\2/g; s/'/\\\\'/g")"
}

# The rendezvous address of HEAD_NODE, looked up inside the job: the first non-loopback IPv4 address its name
# resolves to (many clusters map a node's own name to 127.0.1.1 in /etc/hosts, which the other nodes cannot
# reach), or, on the head node itself, this host's first address; else the name (tests/unit/test_slurm_env.py).
megalm_rdzv_host() {
    local head=$1 addr
    addr=$(getent ahostsv4 "$head" | awk '$1 !~ /^127\./ {print $1; exit}' || true)
    if [[ -z "$addr" && "${SLURMD_NODENAME:-}" == "$head" ]]; then
        addr=$(hostname -I 2>/dev/null | awk '{print $1}' || true)
    fi
    echo "${addr:-$head}"
}

# Processes per node: the GPUs Slurm gave this node (SLURM_GPUS_ON_NODE, or SLURM_GPUS_PER_NODE as "8" or
# "h100:8"), unless NPROC_PER_NODE says otherwise; 1 without GPUs (a CPU run on gloo).
megalm_nproc_per_node() {
    local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
    gpus=${gpus##*:}
    if [[ -n "${NPROC_PER_NODE:-}" ]]; then
        echo "$NPROC_PER_NODE"
    elif [[ "$gpus" =~ ^[0-9]+$ && "$gpus" -gt 0 ]]; then
        echo "$gpus"
    else
        echo 1
    fi
}

# Preemption: the training must get SIGTERM (or SIGUSR1) while srun itself does not get SIGTERM, because srun
# answers SIGTERM by SIGKILLing its tasks ("forcing job termination"): no checkpoint. So:
# - `#SBATCH --signal=B:USR1@120` (Slurm, 120 s before the time limit; or `scancel --batch --signal=USR1`):
#   only this shell gets it; the trap turns it into one SIGTERM to the job steps (`scancel --signal=TERM
#   JOBID` signals the steps, not the batch shell nor srun): torchrun on every node forwards it to its workers.
# - `scancel --signal=TERM JOBID` (or `#SBATCH --signal=TERM@120`, no B:): reaches the steps directly; works too.
# - SIGTERM to the whole job (time limit reached without --signal, preemption without
#   PreemptParameters=send_user_signal, `scancel --full`): srun gets it as well and kills the step; the job
#   resumes from its last periodic checkpoint (trainer.save_interval) if Slurm requeues it. The trap only
#   keeps this shell alive to report srun's status.
MEGALM_SIGNALLED=0
MEGALM_TRAPPED=0
megalm_on_usr1() {
    MEGALM_TRAPPED=1
    if [[ "$MEGALM_SIGNALLED" == 0 ]]; then
        MEGALM_SIGNALLED=1
        megalm_log "SIGUSR1: asking the training processes to checkpoint and exit (SIGTERM to the job step)"
        scancel --signal=TERM "$SLURM_JOB_ID" || megalm_log "scancel failed"
    fi
}
megalm_on_term() {
    MEGALM_TRAPPED=1
    MEGALM_SIGNALLED=1
    megalm_log "SIGTERM to the whole job: srun kills its tasks on it (no checkpoint); see scripts/slurm/lib.sh"
}

# Whether the step's processes asked to be requeued (megalm/train.py: mark_for_requeue leaves one file per rank that
# exits 75) and none failed on its own (mark_failed: a config error, or an exception with no preemption signal).
# One rank's failure makes srun SIGTERM the others, and those still starting up exit 75 with their file: that job
# failed, and a requeue would fail again. A rank killed outright (SIGKILL, a segfault) leaves neither file.
megalm_requeue_asked() {
    local asked=("${MEGALM_REQUEUE_MARKER:?}".rank*) failed=("${MEGALM_REQUEUE_MARKER:?}".failed-rank*)
    [[ -e "${asked[0]}" ]] || return 1
    [[ -e "${failed[0]}" ]] || return 0
    megalm_log "${#asked[@]} process(es) asked to be requeued, but ${#failed[@]} failed on their own (${failed[*]##*.}):" \
        "not requeued"
    return 1
}

# Run srun "$@" in the background (a trap runs only between commands, and `wait` returns at once on a
# trapped signal), wait for it to really end, then requeue on 75 or the marker, else pass the status on.
megalm_srun_and_requeue() {
    local pid rc
    rm -f "${MEGALM_REQUEUE_MARKER:?}".rank* "${MEGALM_REQUEUE_MARKER:?}".failed-rank*
    trap megalm_on_usr1 USR1
    trap megalm_on_term TERM
    srun "$@" &
    pid=$!
    while :; do
        rc=0
        MEGALM_TRAPPED=0
        wait "$pid" || rc=$?
        # A trapped signal cuts `wait` short (status > 128) while srun runs on: wait again. Once srun has
        # ended, `wait` answers with its real status, even if it ended while the trap ran.
        [[ "$MEGALM_TRAPPED" == 1 && "$rc" -gt 128 ]] || break
    done
    trap - USR1 TERM
    if [[ "$rc" == "$EX_TEMPFAIL" ]] || megalm_requeue_asked; then
        megalm_log "the training checkpointed and asked to be requeued (srun exit $rc): scontrol requeue $SLURM_JOB_ID"
        rm -f "${MEGALM_REQUEUE_MARKER:?}".rank*
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    megalm_log "srun exited with $rc"
    exit "$rc"
}

# Everything each job needs before its srun; sets RUN_DIR, LOG_DIR, NPROC and exports the marker path.
megalm_setup() {
    RUN_DIR=$(megalm_run_dir "$@")
    LOG_DIR="$RUN_DIR/slurm"
    mkdir -p "$LOG_DIR"  # srun does not create the directory of --output
    NPROC=$(megalm_nproc_per_node)
    export MEGALM_REQUEUE_MARKER="$LOG_DIR/requeue-$SLURM_JOB_ID"
    # CPU threads per process: torchrun sets 1 when unset; on GPUs 1 is right too (the GPU does the work),
    # raise it for CPU-side data work. Set it here so every rank agrees and torchrun does not warn.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # How long torchrun waits for its workers to write their checkpoint after it forwards SIGTERM before it
    # SIGKILLs them (torch versions whose torchrun has --shutdown-timeout read it; older ones wait 30 s). Keep it under the --signal lead time.
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
    megalm_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}: run dir $RUN_DIR," \
        "$NPROC process(es) per node, per-node logs in $LOG_DIR"
}
