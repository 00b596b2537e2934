#!/usr/bin/env bash
# The real-hardware check of the telemetry issue, on a machine with an NVIDIA GPU, its driver and
# PyTorch: gpuledger's `snapshot`, `record` and `run` beside real workloads (an idle process
# holding device memory throughout; back-to-back matrix products then half-second bursts while
# `record` runs; bursts and a stream of tiny kernels while `run` serves /metrics), with nvitop
# and nvidia-smi read every second beside them. About 3 minutes. Everything lands in
# $OUT (default /tmp/realgpu-out); `python scripts/realgpu/compare.py DIR` lines the readings up.
#
# gpuledger's own dependencies come from wheels in .whl/ when that folder exists (a machine that
# cannot reach a package index), else from the Python environment as it is.
set -u
OUT=${OUT:-/tmp/realgpu-out}
mkdir -p "$OUT" /tmp/gl
exec > >(tee -a "$OUT/log.txt") 2>&1
cd "$(dirname "$0")/../.."

stamp() { echo "=== $(date +%s.%N | cut -c1-14) $*"; }
SITE=/tmp/gl/site
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ||
        exit 3
fi
# Arrays, not functions, so that `timeout` can run them.
GLPY=(env PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 python3)
GL=("${GLPY[@]}" -c 'import sys; from agent.cli.main import main; sys.exit(main())')
apps() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -c '[0-9]'; }

cat >/tmp/gl/config.yaml <<'EOF'
poll_interval: 2s
ledger:
  path: /tmp/gl/ledger.db
  flush_interval: 5s
EOF

stamp machine
uname -a
python3 --version
nvidia-smi
nvidia-smi -q >"$OUT/extra.txt"
cat /proc/self/cgroup

stamp watch starts
"${GLPY[@]}" scripts/realgpu/watch.py --every 1 --for 400 >"$OUT/watch.jsonl" &
WATCH=$!

stamp workloads start: hold 6 GiB, full products for 35 s, then 30 s of bursts
python3 scripts/realgpu/workload.py hold:330 --gib 6 | sed 's/^/[hold] /' &
HOLD=$!
python3 scripts/realgpu/workload.py full:35 duty:30 | sed 's/^/[full] /' &
for _ in $(seq 90); do [ "$(apps)" -ge 2 ] && break; sleep 1; done
stamp "compute apps: $(apps)"
sleep 3

stamp snapshot busy
timeout 120 "${GL[@]}" --debug snapshot --config /tmp/gl/config.yaml --json >"$OUT/snap_busy.json"
echo "snapshot rc $?"

stamp record 80s
timeout 200 "${GL[@]}" record --config /tmp/gl/config.yaml --for 80s --step 2s --out "$OUT/trace.yaml"
echo "record rc $?"

stamp snapshot idle
timeout 120 "${GL[@]}" snapshot --config /tmp/gl/config.yaml --json >"$OUT/snap_idle.json"
echo "snapshot rc $?"

stamp run starts
"${GL[@]}" run --config /tmp/gl/config.yaml --listen 127.0.0.1:9835 &
RUN=$!
sleep 2
stamp workloads: duty 20 s, tiny 20 s
python3 scripts/realgpu/workload.py duty:20 tiny:20 | sed 's/^/[burst] /' &
"${GLPY[@]}" - "$OUT/scrapes.txt" <<'EOF'
import sys, time, urllib.request
with open(sys.argv[1], "w") as out:
    for _ in range(28):
        t = time.time()
        try:
            body = urllib.request.urlopen("http://127.0.0.1:9835/metrics", timeout=5).read().decode()
        except OSError as exc:
            body = f"# error {exc!r}\n"
        out.write(f"# SCRAPE {t:.3f}\n{body}")
        out.flush()
        time.sleep(max(0.0, t + 2 - time.time()))
EOF
stamp run stops
kill -TERM "$RUN"
wait "$RUN"
echo "run rc $?"

stamp report
{
    echo "=== report"
    timeout 60 "${GL[@]}" report --config /tmp/gl/config.yaml --ledger /tmp/gl/ledger.db --since 1d --by gpu,user,model
    echo "=== report json"
    timeout 60 "${GL[@]}" report --config /tmp/gl/config.yaml --ledger /tmp/gl/ledger.db --since 1d --format json
} >>"$OUT/extra.txt" 2>&1

# No bare `wait`: bash 5.1 on waits for the `tee` above too, which never ends.
kill "$HOLD" "$WATCH" 2>/dev/null
pkill -f scripts/realgpu/workload.py
stamp done
