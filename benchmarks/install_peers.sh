#!/usr/bin/env bash
# Installs the peers `banyan bench compare` measures banyan against. banyan itself never installs
# them. Everything lands under ${BANYAN_PEERS_DIR:-~/.cache/banyan/peers} and is reused when there.
#
#   benchmarks/install_peers.sh                  # both peers
#   benchmarks/install_peers.sh transformers     # the fp32 Hugging Face checkpoint only
#   benchmarks/install_peers.sh llama-server     # build llama.cpp's server only (10-20 min on 2 cores)
#
# transformers: banyan's dependency already; the peer needs the model's (GGUF) weights as a plain
#   fp32 Hugging Face directory (not a packed-quantized path), written once by banyan's GGUF loader.
# llama-server: built from the llama-cpp-python source distribution (its vendor/llama.cpp), only the
#   server target, static, tuned for this CPU (GGML_NATIVE), without curl (nothing is downloaded).
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

case "${1:-all}" in
    transformers) install_transformers ;;
    llama-server) install_llama_server ;;
    all) install_transformers; install_llama_server ;;
    *) echo "usage: $0 [all|transformers|llama-server]" >&2; exit 2 ;;
esac
