#!/usr/bin/env bash
# The learner worker under a supervisor that restarts it (systemd, supervisord, a Slurm node, a requeued
# job): with --resume when run.output_dir already holds a checkpoint, so a learner restarted after a crash
# continues from its newest checkpoint instead of training the base model again into a run in progress
# (docs/learner.md, "Resume after a crash"). Without a checkpoint it starts fresh, as the Procfile's line.
#
#   ops/launch/learner.sh -c CONFIG [--set SECTION.KEY=VALUE ...]      (what ops/launch/Procfile runs)
#
# ROLLSTREAM_LEARNER_NPROC=N runs the learner as N FSDP2 processes under torchrun; the config must then say
# grpo.world_size = N (every worker derives the batch plan from it). ROLLSTREAM_BIN: the directory of the
# rollstream and torchrun executables (default .venv/bin). ROLLSTREAM_LAUNCH_DRY_RUN=1 prints the command
# line (shell-quoted) instead of running it.
set -euo pipefail

bin=${ROLLSTREAM_BIN:-.venv/bin}
nproc=${ROLLSTREAM_LEARNER_NPROC:-1}

# run.output_dir as the worker will see it: the same config and overrides (-c, --set; not the worker's own
# flags), resolved by rollstream itself, which also fails here, naming the field, on a config that would
# not load.
config_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
    -c | --config | --set) config_args+=("${args[i]}" "${args[i + 1]:-}") && i=$((i + 1)) ;;
    -c=* | --config=* | --set=*) config_args+=("${args[i]}") ;;
    esac
done
resolved=$("$bin/rollstream" config show "${config_args[@]}")
output_dir=$(sed -n 's/^output_dir = "\(.*\)"$/\1/p' <<<"$resolved" | head -n 1)

resume=()
if [[ -n $output_dir ]] && compgen -G "$output_dir/checkpoint-*" >/dev/null; then
    resume=(--resume)
fi

if [[ ! $nproc =~ ^[1-9][0-9]*$ ]]; then
    echo "ROLLSTREAM_LEARNER_NPROC=$nproc: give a whole number of learner processes (1 = no torchrun)" >&2
    exit 2
fi
if ((nproc > 1)); then
    command=("$bin/torchrun" --nproc_per_node "$nproc" -m rollstream.cli worker learner "$@" "${resume[@]}")
else
    command=("$bin/rollstream" worker learner "$@" "${resume[@]}")
fi

if [[ ${ROLLSTREAM_LAUNCH_DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
exec "${command[@]}"
