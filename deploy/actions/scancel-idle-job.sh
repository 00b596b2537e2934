#!/bin/sh
# gpuledger action: cancel the Slurm job that holds GPUs and leaves them idle (a trigger with
# `flag: allocated_idle` and `scope: workload`, allowed only for Slurm jobs: `allow:
# {hpc_jobs: ["*"]}`). Runs scancel as the agent's user (root: a Slurm operator by default).
set -eu

job=${GPULEDGER_HPC_JOB:-}
# A job id, or an array task's <job>_<task>; anything else is refused, never handed to scancel.
case $job in
    '' | *[!0-9_]* | _* | *_ | *_*_*)
        echo "scancel-idle-job: not a Slurm job id: '$job' (scope it to jobs: allow: {hpc_jobs: [\"*\"]})" >&2
        exit 2
        ;;
esac

echo "cancelling job $job: ${GPULEDGER_SUMMARY:-}"
exec scancel "$job"
