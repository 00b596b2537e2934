"""Runs the tests' `gpuledger` command lines, each in a process of its own, forked from one that
has already imported the agent; and `CliServer`, the tests' side of it.

A command line the tests run is a real process: its own pid, environment, working directory,
stdin (/dev/null), stdout and stderr (files the caller reads back), exit code and interpreter
shutdown, as `python -m agent ARGS` would have. What it skips is the import of the agent and its
libraries, about 0.35 s of CPU each time: the suite runs a couple of hundred of them. What it
shares with the server: the modules in PREIMPORTED, already imported, and the string hash seed
(every child iterates a set of strings in the same order, where fresh interpreters would not).

    python -m tests.cli_server

Requests come on stdin, one JSON line each: {"args": [...], "env": {...}, "cwd": ...,
"stdout": path, "stderr": path}. For each, one JSON line with the child's pid as soon as it is
forked ({"pid": N}), then one with its exit code once it has ended ({"code": N}, negative for a
signal, as subprocess gives it). Only imports happen before a fork: no thread, socket or driver
is started, and the server checks that no thread is running before it forks.

Settings an interpreter reads only as it starts (PYTHONPATH, PYTHONHASHSEED, the locale) cannot
change in a forked child: `tests.test_cli.gpuledger` starts a fresh interpreter for a command
whose environment changes one of those.
"""

from __future__ import annotations

import importlib
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# What the commands import on first use (building an agent, the fake node, the HTTP side, the
# scheduler, the report page), imported once by the server rather than in each command.
PREIMPORTED = (
    "agent.cli.main",
    "agent.cli.wiring",
    "agent.cli.simulate",
    "agent.cli.record",
    "agent.cli.render",
    "agent.cli.recommend",
    "agent.cli.reportpage",
    "apscheduler.schedulers.background",
    "exporters.http",
    "exporters.webconfig",
    "fake_nvml",
    "tqdm",
)

MAIN = str(Path(__file__).resolve().parent.parent / "agent" / "__main__.py")  # sys.argv[0] under `python -m agent`


def _reply(message: dict[str, int]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _requests() -> dict[str, object] | None:
    """Serve until stdin closes (None). In a forked child, the request it is to run."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(0, 65536)
            if not chunk:
                return None
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        request: dict[str, object] = json.loads(line)
        if threading.active_count() != 1:
            raise RuntimeError(f"threads are running in the CLI server: {threading.enumerate()}")
        pid = os.fork()
        if pid == 0:
            return request
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"code": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, object]) -> list[str]:
    """This child as `python -m agent ARGS` would start: its files, directory and environment."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115 - the process's stdin
    os.chdir(str(request["cwd"]))
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    time.tzset()
    args = [str(arg) for arg in request["args"]]  # type: ignore[attr-defined]
    sys.argv = [MAIN, *args]
    return args


# What only a fresh interpreter takes from its environment: a command whose environment differs
# from the server's in one of these is run the ordinary way.
_STARTUP_PREFIXES = ("PYTHON", "LC_")
_STARTUP_NAMES = frozenset({"LANG", "LANGUAGE"})


class CliServer:
    """The tests' side: `run` is `subprocess.run([python, -m, agent, *args], capture_output=True,
    text=True, ...)`, with the command forked from the server (started on first use, again if
    it died). One command at a time; the server ends when this process closes its stdin."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._server: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}

    def run(
        self, args: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float | None
    ) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "agent", *args]
        with self._lock:
            server = self._started()
            if _startup_settings(env) != _startup_settings(self._env):
                return subprocess.run(
                    argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=dict(env), check=False
                )
            with tempfile.TemporaryDirectory(prefix="gpuledger-cli-") as files:
                out, err = Path(files) / "stdout", Path(files) / "stderr"
                request = {
                    "args": list(args),
                    "env": dict(env),
                    "cwd": str(cwd),
                    "stdout": str(out),
                    "stderr": str(err),
                }
                assert server.stdin is not None
                server.stdin.write((json.dumps(request) + "\n").encode())
                server.stdin.flush()
                pid = self._answer(server, None)["pid"]
                answer = self._answer(server, timeout)
                if answer is None:
                    os.kill(pid, signal.SIGKILL)
                    self._answer(server, None)
                    raise subprocess.TimeoutExpired(argv, timeout or 0.0, _read(out), _read(err))
                return subprocess.CompletedProcess(argv, answer["code"], _read(out), _read(err))

    def _started(self) -> subprocess.Popen[bytes]:
        server = self._server
        if server is None or server.poll() is not None:
            self._env = dict(os.environ)
            server = self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.cli_server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                bufsize=0, cwd=self.root, env=self._env,
            )  # fmt: skip
        return server

    @staticmethod
    def _answer(server: subprocess.Popen[bytes], timeout: float | None) -> dict[str, int] | None:
        """The server's next line, or None if `timeout` seconds pass first (its stdout is
        unbuffered, so a line not yet read is still in the pipe, where `select` sees it)."""
        assert server.stdout is not None
        if timeout is not None and not select.select([server.stdout], [], [], timeout)[0]:
            return None
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI server ended (exit code {server.wait()})")
        answer: dict[str, int] = json.loads(line)
        return answer


def _startup_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) or k in _STARTUP_NAMES}


def _read(path: Path) -> str:
    """A command's output as `subprocess.run(text=True)` decodes it."""
    with path.open(encoding=locale.getpreferredencoding(False)) as f:
        return f.read()


if __name__ == "__main__":
    for _module in PREIMPORTED:
        importlib.import_module(_module)
    from agent.cli.main import main

    found = _requests()
    if found is not None:
        # As agent/__main__.py: the interpreter then shuts down as it would (atexit, threads).
        sys.exit(main(_become(found)))
