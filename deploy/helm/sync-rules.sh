#!/usr/bin/env bash
# Copies the Prometheus rule files of deploy/prometheus into the chart (files/), which its
# PrometheusRule reads with .Files.Get: Helm packages only what is inside the chart directory.
# Run it after changing a rule; tests/test_deploy.py fails while the copies differ.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/../prometheus"
dst="$here/gpuledger/files"
mkdir -p "$dst"
for name in gpuledger-recording.rules.yml gpuledger-alerts.rules.yml gpuledger-fleet.rules.yml gpuledger-work.rules.yml; do
    cp "$src/$name" "$dst/$name"
    echo "synced $dst/$name"
done
