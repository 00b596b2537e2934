#!/bin/bash
# gpuledger's Slurm epilog: removes the map files the prolog wrote for this job. Only files
# that still name this job go: a GPU already handed to the next job keeps that job's file.
#
# slurm.conf:  Epilog=/etc/slurm/epilog.d/gpuledger.sh   (run by slurmd as root)
#
# An epilog that fails drains the node: this one never fails.
map_dir=${GPULEDGER_ATTRIBUTION__SLURM_MAP_DIR:-/run/gpuledger/jobs}
[ -n "${SLURM_JOB_ID:-}" ] && [ -d "$map_dir" ] || exit 0
for file in "$map_dir"/*; do
    [ -f "$file" ] && [ ! -L "$file" ] || continue
    job=
    read -r job _ < "$file" 2>/dev/null  # false on a last line with no newline, job read all the same
    [ "${job%%=*}" = "$SLURM_JOB_ID" ] && rm -f "$file"  # an array task's is JOBID=ARRAYJOB_TASK
done
exit 0
