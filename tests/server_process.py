"""A real `banyan serve` subprocess on 127.0.0.1, for tests that talk to it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


PORT_TAKEN = "address already in use"


class _PortTaken(Exception):
    """Another process bound the port between free_port() and the server's bind."""


def start_server(model_dir, *args: str, env: dict | None = None, ready_timeout: float = 180.0,
                 launcher: Sequence[str] = (sys.executable, "-m", "banyan.cli"), cwd=None) -> ServerProcess:
    """Start `banyan serve` on a free port and wait until it answers /health 200 (`launcher`: how to run banyan's CLI).
    A port free_port() found can be bound by another test's server before this one binds it (tests run side by side):
    then that server answers /health, so the answer counts only once this server announced its URL and outlived its
    bind, and a server that lost the port is started again on another."""
    for _ in range(3):
        port = free_port()
        log = tempfile.NamedTemporaryFile("w", prefix="banyan-serve-", suffix=".log", delete=False)
        cmd = [*launcher, "serve", "--model", str(model_dir), "--port", str(port),
               "--num-threads", "1", "--block-size", "4", *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
        try:
            return _wait_healthy(ServerProcess(proc, port, log.name), ready_timeout)
        except _PortTaken:
            continue
    raise RuntimeError("banyan serve lost its port three times")


def _wait_healthy(server: ServerProcess, ready_timeout: float) -> ServerProcess:
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            if PORT_TAKEN in server.log():
                raise _PortTaken
            raise RuntimeError(f"banyan serve exited with {server.proc.returncode}:\n{server.log()}")
        try:
            healthy = httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and f":{server.port}/v1" in server.log():  # it announced its URL: its bind comes right after
            time.sleep(0.3)
            if server.proc.poll() is None and PORT_TAKEN not in server.log():
                return server
            server.stop(signal.SIGKILL)
            raise _PortTaken
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"banyan serve did not become healthy:\n{server.log()}")
