"""The peers `banyan bench compare` measures banyan against. benchmarks/install_peers.sh installs
them under peers_dir(); banyan never installs them itself.

    export_hf.py            a model's weights as a plain fp32 Hugging Face directory (for transformers)
    transformers_runner.py  transformers generate(): static batches, left padding (offline only)
    llama_server.py         llama.cpp's llama-server: where the binary is, its command line
    vllm_cpu.py             vLLM's CPU build: where its virtualenv is, its server's command line, offline runs
    vllm_offline.py         the script vLLM's own python runs for offline (imports nothing of banyan)
"""

from __future__ import annotations

import os
from pathlib import Path


def peers_dir() -> Path:
    """Where install_peers.sh puts the peers: $BANYAN_PEERS_DIR, else ~/.cache/banyan/peers."""
    return Path(os.environ.get("BANYAN_PEERS_DIR") or Path.home() / ".cache" / "banyan" / "peers")
