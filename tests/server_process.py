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


def start_server(model_dir, *args: str, env: dict | None = None, ready_timeout: float = 180.0,
                 launcher: Sequence[str] = (sys.executable, "-m", "banyan.cli"), cwd=None) -> ServerProcess:
    """Start `banyan serve` on a free port and wait until /health answers 200 (`launcher`: how to run banyan's CLI)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="banyan-serve-", suffix=".log", delete=False)
    cmd = [*launcher, "serve", "--model", str(model_dir), "--port", str(port),
           "--num-threads", "1", "--block-size", "4", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
    server = ServerProcess(proc, port, log.name)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"banyan serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"banyan serve did not become healthy:\n{server.log()}")
