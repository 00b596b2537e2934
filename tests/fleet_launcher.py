"""Starts many `gpuledger run` processes at once: imports the agent once, then forks one child per
node, each running the command line's own `main(argv)` with its own arguments, log file and
process group, exactly as `gpuledger run ...` would from a shell.

Forty interpreters each importing the agent cost some 30 CPU-seconds on a 2-core CI runner
before a single poll; forked from one that already has, they start in a fraction of a second
each. Nothing is started before the fork (no thread, no gRPC channel, no NVML): each child
builds its whole agent itself.

    python -m tests.fleet_launcher NODES.json

NODES.json is a list of {"argv": [...], "log": path}. Prints one JSON line with the children's
pids, in order, once all are forked; then waits for them and prints one JSON line with their
exit codes (signal them directly: SIGTERM stops each as it stops `gpuledger run`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from agent.cli.main import main

# What `run --fake` imports on first use (the wiring, the fake, the HTTP side, the scheduler),
# imported here once rather than in each child: 0.17 s of CPU a child, 7 s for forty.
for _module in (
    "agent.cli.wiring",
    "apscheduler.schedulers.background",
    "exporters.http",
    "exporters.webconfig",
    "fake_nvml",
):
    importlib.import_module(_module)


def _child(argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run(specs: list[dict[str, object]]) -> list[int]:
    pids = []
    for spec in specs:
        argv = [str(arg) for arg in spec["argv"]]  # type: ignore[attr-defined]
        pid = os.fork()
        if pid == 0:
            _child(argv, str(spec["log"]))
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    return codes


if __name__ == "__main__":
    specs = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    print(json.dumps({"exit_codes": run(specs)}), flush=True)
