"""Servers `banyan bench compare` starts and stops itself: `banyan serve` and llama-server, each a
subprocess on a free local port, ready once GET /health answers 200, stopped with SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from banyan.config import EngineConfig
from banyan.config_args import engine_flags


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /health in time; `log` is the end of what it printed."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log

    @property
    def summary(self) -> str:
        """One line: what happened and the log's last line that names an error (else its last line)."""
        lines = [line.strip() for line in self.log.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        last = (errors or lines)[-1:]
        return f"{self.args[0]}: {last[0]}" if last else self.args[0]

    def __str__(self) -> str:  # a traceback then names the server's own error, not only its exit status
        return self.summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(cmd: list[str], port: int, *, ready_timeout: float) -> Iterator[str]:
    """Run `cmd` (listening on `port`) for the duration of the block; yields its base URL."""
    with launched_process(cmd, port, ready_timeout=ready_timeout) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def launched_process(cmd: list[str], port: int, *, ready_timeout: float,
                     output: str | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """As `launched`, also yielding the process (its pid, and its exit status once the block is left).
    output: where its stdout and stderr go instead of a log file (/dev/full: a disk that is full)."""
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="banyan-bench-server-", suffix=".log") as log:
        sink = open(output, "w") if output else log  # noqa: SIM115 - closed below, after the process
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_ready(proc, base_url, ready_timeout, Path(log.name))
            yield base_url, proc
        finally:
            _stop(proc)
            if sink is not log:
                sink.close()


def banyan_serve_cmd(config: EngineConfig, port: int) -> list[str]:
    """`banyan serve` with this engine config (the fields that differ from their defaults)."""
    return [sys.executable, "-m", "banyan.cli", "serve", "--port", str(port), *engine_flags(config)]


def wait_ready(proc: subprocess.Popen, base_url: str, timeout: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{proc.args[0]} exited with {proc.returncode}", _tail(log))
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise ServerStartError(f"{proc.args[0]} did not answer {base_url}/health within {timeout:.0f} s", _tail(log))


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-chars:]
