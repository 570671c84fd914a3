"""llama.cpp's llama-server as a peer: where benchmarks/install_peers.sh left the binary, and the
command line that serves the same GGUF with --parallel slots and continuous batching.

Its defaults are kept where they are llama.cpp's best on CPU: weight repacking (--repack: Q4_1 is
rearranged for its SIMD kernels at load time), prompt caching per slot, the RAM prompt cache. Except on CPUs with
AMX: there repacking puts the weights in ggml's AMX buffers, whose matmul segfaulted in the first forward of the
default model's Q4_1 (llama-cpp-python's vendored llama.cpp, build b1-0c1e570; Xeon with AMX-INT8, 2026-12-03), so
it runs with --no-repack, its AVX-512 kernels.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from banyan.bench.peers import peers_dir
from banyan.kernels.cpu_features import cpu_flags

INSTALL_HINT = "run benchmarks/install_peers.sh llama-server (builds it in 10-20 min on 2 cores)"


def find_llama_server() -> Path | None:
    """$BANYAN_LLAMA_SERVER, else the one install_peers.sh built, else llama-server on PATH."""
    candidates = [os.environ.get("BANYAN_LLAMA_SERVER"), peers_dir() / "llama-server", shutil.which("llama-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return Path(candidate)
    return None


def llama_server_cmd(binary: Path, gguf: Path, port: int, *, parallel: int, slot_len: int, num_threads: int) -> list[str]:
    """Serve `gguf` on 127.0.0.1:port with `parallel` slots of slot_len tokens of context each."""
    return [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(parallel), "--cont-batching", "--ctx-size", str(parallel * slot_len),
        "--threads", str(num_threads), "--threads-batch", str(num_threads), "--no-webui",
        *(["--no-repack"] if "amx_int8" in cpu_flags() else []),  # see the module docstring
    ]  # fmt: skip
