#!/bin/sh
# gpuledger action: stop this Compute Engine instance (a trigger with `flag: idle` and
# `scope: node`). Its name and zone come from the metadata server; stopping needs the gcloud CLI
# and a service account allowed compute.instances.stop on it. Its disks are kept.
set -eu

metadata=${METADATA_ENDPOINT:-http://metadata.google.internal/computeMetadata/v1}

if [ "${GPULEDGER_SCOPE:-}" != node ]; then
    echo "stop-instance-gcp: acts on a whole node (scope: node), not on scope '${GPULEDGER_SCOPE:-}'" >&2
    exit 2
fi

meta() {
    curl -sSf -m 5 -H "Metadata-Flavor: Google" "$metadata/instance/$1"
}
name=$(meta name)
zone=$(meta zone)  # projects/<number>/zones/<zone>
zone=${zone##*/}
if [ -z "$name" ] || [ -z "$zone" ]; then
    echo "stop-instance-gcp: the metadata server gave no instance name or zone" >&2
    exit 1
fi

echo "stopping $name in $zone: ${GPULEDGER_SUMMARY:-}"
exec gcloud compute instances stop "$name" --zone "$zone" --quiet
