#!/usr/bin/env bash
# One node's share of a rollstream run under Slurm (ops/launch/slurm/rollstream.sbatch starts it, one job
# step per node; docs/launch.md). Roles:
#   redis    Redis for the run (ops/launch/redis-conf.sh: AOF, ACL, password), in the foreground
#   reset    delete the run's streams (a fresh run: no checkpoint in the output directory yet)
#   learner  the learner (ops/launch/learner.sh: --resume when a checkpoint exists), the feeder, the
#            advantage worker, and an evaluate worker with ROLLSTREAM_EVALUATE=1
#   rollout  ROLLSTREAM_ROLLOUTS_PER_NODE rollout workers (the node's GPUs split between them) and
#            ROLLSTREAM_REWARDS_PER_NODE reward workers
# Every worker reads one config: ROLLSTREAM_CONFIG with this job's settings put in by rollstream itself
# (`rollstream config show`, which also rejects a bad field before anything starts), written on this node
# only (it holds the Redis password). A failed worker is restarted (at most ROLLSTREAM_RESTARTS times);
# exit 0 (the run is over) and 2 (a config or user error) are not. SIGTERM to this script is forwarded to
# each worker's main process alone, which drains (the learner checkpoints); the workers run in sessions of
# their own, so a signal to this step's process group does not reach their children (vLLM's engine core).
# ROLLSTREAM_LAUNCH_DRY_RUN=1: print each worker's command line (shell-quoted) instead of starting it.
set -euo pipefail

role=${1:?usage: node.sh redis|reset|learner|rollout}
cd "${ROLLSTREAM_DIR:?set ROLLSTREAM_DIR to the rollstream checkout (with its .venv) every node sees}"
bin=${ROLLSTREAM_BIN:-$ROLLSTREAM_DIR/.venv/bin}
dry_run=${ROLLSTREAM_LAUNCH_DRY_RUN:-0}
output_dir=${ROLLSTREAM_OUTPUT_DIR:?set ROLLSTREAM_OUTPUT_DIR to the run\'s output directory (absolute)}
redis_host=${ROLLSTREAM_REDIS_HOST:?set ROLLSTREAM_REDIS_HOST to the address of the Redis node}
redis_port=${ROLLSTREAM_REDIS_PORT:-6379}
metrics_port=${ROLLSTREAM_METRICS_PORT:-9400}
max_restarts=${ROLLSTREAM_RESTARTS:-3}
if [[ $output_dir != /* ]]; then
    echo "ROLLSTREAM_OUTPUT_DIR=$output_dir: give an absolute path (every worker must name the same place)" >&2
    exit 2
fi

# This node's copy of the job's config (the Redis password is in it: mode 600, removed at exit).
job_dir=$(mktemp -d "${TMPDIR:-/tmp}/rollstream-job.XXXXXX")
if [[ $dry_run != 1 ]]; then
    trap 'rm -rf "$job_dir"' EXIT
fi
job_config=$job_dir/run.toml

make_config() {
    local password=${REDIS_PASSWORD:?set REDIS_PASSWORD (the sbatch script makes one per job)}
    local scheme=redis query=""
    if [[ -n ${REDIS_TLS_CA:-} ]]; then
        scheme=rediss
        query="?ssl_ca_certs=$REDIS_TLS_CA"
    fi
    local settings=(
        --set 'transport.kind="redis"'
        --set "transport.url=\"$scheme://rollstream:$password@$redis_host:$redis_port/0$query\""
        --set "run.output_dir=\"$output_dir\""
        --set "run.metrics_port=$metrics_port"
        --set "grpo.world_size=${ROLLSTREAM_LEARNER_NPROC:-1}"
        --set "rollout.weight_transport=\"${ROLLSTREAM_WEIGHT_SYNC:-broadcast}\""
    )
    if [[ -n ${ROLLSTREAM_RUN_NAME:-} ]]; then
        settings+=(--set "run.name=\"$ROLLSTREAM_RUN_NAME\"")
    fi
    (umask 077 && "$bin/rollstream" config show -c "${ROLLSTREAM_CONFIG:?set ROLLSTREAM_CONFIG to the run\'s TOML}" \
        "${settings[@]}" >"$job_config")
}

pids=()
last_pid=""
stopping=0
# shellcheck disable=SC2329  # called by the trap at the end
stop_all() {
    stopping=1
    if ((${#pids[@]})); then
        kill -TERM "${pids[@]}" 2>/dev/null || true
    fi
}

# supervise NAME COMMAND...: run it in a session of its own, restart it when it fails.
supervise() {
    local name=$1 restarts=0 child=0 rc
    shift
    trap 'stopping=1; ((child)) && kill -TERM "$child" 2>/dev/null' TERM INT
    while true; do
        setsid "$@" &
        child=$!
        rc=0
        wait "$child" || rc=$?
        # a trapped signal ends `wait` early: wait again for the worker's own exit status
        while kill -0 "$child" 2>/dev/null; do
            rc=0
            wait "$child" || rc=$?
        done
        if ((stopping || rc == 0 || rc == 2 || restarts >= max_restarts)); then
            echo "node.sh: $name exited with $rc" >&2
            return "$rc"
        fi
        restarts=$((restarts + 1))
        echo "node.sh: $name failed with $rc; restart $restarts of $max_restarts" >&2
    done
}

start() {
    local name=$1
    shift
    if [[ $dry_run == 1 ]]; then
        printf '%q ' "$@"
        echo
        return
    fi
    supervise "$name" "$@" &
    last_pid=$!
    pids+=("$last_pid")
}

# --metrics-port for the copy-th worker (1-based) of a stage: the config's port + the stage's offset
# (feeder 0, rollout 1, reward 2, advantage 3, learner 4, evaluate 5: ops/prometheus.yml) + 10 per copy.
port_of() {
    if ((metrics_port == 0)); then
        echo 0
    else
        echo $((metrics_port + $1 + 10 * ($2 - 1)))
    fi
}

cmd=()
worker_command() {  # STAGE OFFSET COPY: the worker's command line into cmd
    cmd=("$bin/rollstream" worker "$1" -c "$job_config" --metrics-port "$(port_of "$2" "$3")")
}

case $role in
redis)
    mkdir -p "$output_dir/redis"
    (umask 077 && ops/launch/redis-conf.sh "${ROLLSTREAM_REDIS_BIND:-$redis_host}" "$redis_port" \
        "$output_dir/redis" >"$job_dir/redis.conf")
    start redis redis-server "$job_dir/redis.conf"
    ;;
reset)
    make_config
    start reset "$bin/rollstream" reset -c "$job_config"
    ;;
learner)
    make_config
    mkdir -p "$output_dir"
    worker_command feeder 0 1
    start feeder "${cmd[@]}"
    start learner env ROLLSTREAM_BIN="$bin" ops/launch/learner.sh -c "$job_config" \
        --metrics-port "$(port_of 4 1)"
    learner_pid=$last_pid
    worker_command advantage 3 1
    start advantage "${cmd[@]}"
    if [[ ${ROLLSTREAM_EVALUATE:-0} == 1 ]]; then
        worker_command evaluate 5 1
        start evaluate "${cmd[@]}"
    fi
    ;;
rollout)
    make_config
    rollouts=${ROLLSTREAM_ROLLOUTS_PER_NODE:-1}
    gpus=${ROLLSTREAM_GPUS_PER_NODE:-0}
    if ((rollouts < 1 || (gpus > 0 && gpus % rollouts != 0))); then
        echo "ROLLSTREAM_ROLLOUTS_PER_NODE=$rollouts: give at least 1, dividing ROLLSTREAM_GPUS_PER_NODE=$gpus" >&2
        exit 2
    fi
    for ((copy = 1; copy <= rollouts; copy++)); do
        devices=()
        if ((gpus > 0)); then  # copy k takes GPUs [(k-1)*g, k*g), g = GPUs / rollouts (= tensor_parallel_size)
            per=$((gpus / rollouts))
            devices=("CUDA_VISIBLE_DEVICES=$(seq -s, $(((copy - 1) * per)) $((copy * per - 1)))")
        fi
        worker_command rollout 1 "$copy"
        start "rollout-$copy" env "${devices[@]}" "${cmd[@]}"
    done
    for ((copy = 1; copy <= ${ROLLSTREAM_REWARDS_PER_NODE:-1}; copy++)); do
        worker_command reward 2 "$copy"
        start "reward-$copy" "${cmd[@]}"
    done
    ;;
*)
    echo "node.sh: unknown role $role (redis, reset, learner or rollout)" >&2
    exit 2
    ;;
esac

[[ $dry_run == 1 ]] && exit 0
trap stop_all TERM INT

status=0
wait_for() {  # wait_for PID: until it has exited (a trapped signal ends `wait` early), its exit status in status
    status=0
    wait "$1" || status=$?
    while kill -0 "$1" 2>/dev/null; do
        status=0
        wait "$1" || status=$?
    done
}

rc=0
if [[ $role == learner ]]; then
    # the learner ends the run; one that gave up leaves nothing for the feeder and advantage worker to do
    wait_for "$learner_pid"
    rc=$status
    if ((rc != 0)); then
        stop_all
    fi
fi
for pid in "${pids[@]}"; do
    wait_for "$pid"
    if ((status != 0 && rc == 0)); then
        rc=$status
    fi
done
exit "$rc"
