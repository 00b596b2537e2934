#!/bin/bash
# gpuledger's Slurm prolog: one map file per GPU the job was allocated on this node, holding
# "JOBID USER ACCOUNT", so the agent charges the job for its GPUs even while nothing runs on
# them (attribution.slurm_map_dir; see the README's Attribution section).
#
# slurm.conf:  Prolog=/etc/slurm/prolog.d/gpuledger.sh   (run by slurmd as root; with
#              PrologFlags=Alloc it runs at allocation, so idle allocations are charged too)
#
# A prolog that fails drains the node: this one never fails. Each file is written under a
# temporary name and renamed into place, so the agent never reads half of one; its
# modification time is the job's start on that GPU. Whole GPUs only: SLURM_JOB_GPUS holds the
# numbers of the /dev/nvidia<N> files (gres.conf File=) Slurm allocated, the driver's minor
# numbers, which need not be NVML's GPU indexes: each file is named nvidia<N>, and the agent finds
# the GPU by its minor number. An array task has a job id of its own, which slurmd names its
# cgroup by, and is known to users as <array job id>_<task id> (squeue, sacct): it is written
# "JOBID=ARRAYJOB_TASK", where the prolog is given SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID
# (Slurm's prolog guide lists them for PrologSlurmctld only; without them, the plain JOBID).
map_dir=${GPULEDGER_ATTRIBUTION__SLURM_MAP_DIR:-/run/gpuledger/jobs}
[ -n "${SLURM_JOB_GPUS:-}" ] && [ -n "${SLURM_JOB_ID:-}" ] || exit 0
job=$SLURM_JOB_ID
case ${SLURM_ARRAY_JOB_ID:-}_${SLURM_ARRAY_TASK_ID:-} in
    _* | *_ | *[!0-9_]*) ;;
    *) job="$SLURM_JOB_ID=${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID" ;;
esac
umask 022
mkdir -p "$map_dir" 2>/dev/null || exit 0
IFS=, read -ra gpus <<< "$SLURM_JOB_GPUS"
for gpu in "${gpus[@]}"; do
    case $gpu in *[!0-9]* | '') continue ;; esac
    tmp=$(mktemp "$map_dir/.nvidia$gpu.XXXXXX" 2>/dev/null) || continue
    if printf '%s %s %s\n' "$job" "${SLURM_JOB_USER:-}" "${SLURM_JOB_ACCOUNT:-}" > "$tmp" \
        && chmod 0644 "$tmp" && mv -f "$tmp" "$map_dir/nvidia$gpu"; then
        continue
    fi
    rm -f "$tmp"
done
exit 0
