"""`banyan bench lora`: the throughput cost of serving LoRA adapters, side by side in one process.

Random PEFT adapters (rank --lora-rank, every q/k/v/o/gate/up/down projection) are written for the model's shape
to a temporary directory. Three configurations run the same prompts (ignore_eos, every request at once):

    base           LLM without LoRA
    lora-off-rows  LLM(enable_lora=True), every request on the base model: what enabling LoRA costs by itself
    mixed          the same LLM, request i on adapter i % --num-adapters: one batch of mixed adapters

Each configuration has its own engine, and the engines step in turn on the same prompts (the first one rotating
each turn), each step timed: load that drifts on a shared machine falls on all of them within a step of each
other (whole runs one after the other moved by up to 40% here). tok/s sums tokens and step seconds over the
rounds; `cost` is the median over rounds of 1 - tok/s / base tok/s within the round (`spread`: its smallest and
largest values).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from banyan.bench.workloads import BenchPrompt, random_prompts
from banyan.config import EngineConfig, LoRAConfig, ModelArch
from banyan.frontend.llm import LLM, collections_paused
from banyan.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE, projection_shapes
from banyan.lora.request import LoRARequest
from banyan.sampling_params import SamplingParams


def write_random_adapter(path: Path, arch: ModelArch, rank: int, seed: int, alpha: float = 32.0) -> None:
    """A PEFT-layout adapter for `arch` with small random A and B on every target of every layer."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for target, (fan_in, fan_out) in projection_shapes(arch).items():
            name = f"base_model.model.model.layers.{layer}.{TARGETS[target].module.split('.')[0]}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(TARGETS), "bias": "none"}
    (path / CONFIG_FILE).write_text(json.dumps(config))


def run_lora(config: EngineConfig, args) -> tuple[dict, dict]:
    lora = LoRAConfig(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.lora_rank)
    with tempfile.TemporaryDirectory(prefix="banyan-bench-lora-") as tmp:
        base = LLM.from_config(config.replace(lora=LoRAConfig()))
        adapters = []
        for i in range(args.num_adapters):
            write_random_adapter(Path(tmp) / f"a{i}", base.engine.arch, args.lora_rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        prompts = random_prompts(args.num_prompts, args.input_len, args.output_len, base.engine.arch.vocab_size,
                                 seed=args.workload_seed)
        runs = {  # one engine each: they step in turn, so none batches another's requests
            "base": (base.engine, [None] * len(prompts)),
            "lora-off-rows": (LLM.from_config(config.replace(lora=lora)).engine, [None] * len(prompts)),
            "mixed": (LLM.from_config(config.replace(lora=lora)).engine,
                      [adapters[i % len(adapters)] for i in range(len(prompts))]),
        }
        params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
        warm_up = [BenchPrompt(p.prompt_token_ids, 2) for p in prompts]  # adapters loaded and resident
        _interleaved(runs, warm_up, params.clone(max_tokens=2), "warm")
        per_round = [_interleaved(runs, prompts, params, str(r)) for r in range(args.rounds)]
    results = {}
    for name in runs:
        tokens, seconds = (sum(r[name][k] for r in per_round) for k in (0, 1))
        costs = sorted(1 - (r[name][0] / r[name][1]) / (r["base"][0] / r["base"][1]) for r in per_round)
        results[name] = {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
                         "cost": statistics.median(costs), "spread": [costs[0], costs[-1]],
                         "per_round_tok_s": [r[name][0] / r[name][1] for r in per_round]}
    bench = {k: v for k, v in vars(args).items() if k != "func"}
    return {"bench": bench}, {"runs": results, "device": base.engine.device, "dtype": base.engine.dtype}


def _interleaved(runs: dict, prompts: list[BenchPrompt], params: SamplingParams, tag: str) -> dict[str, list]:
    """Every engine gets the same prompts, then they step in turn (the first one rotating) until all are done:
    load that drifts on a shared machine falls on each within a step of the others. Returns, per configuration,
    [output tokens, seconds inside its own steps]."""
    for name, (engine, loras) in runs.items():
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(f"{name}-{tag}-{i}", prompt.prompt_token_ids, params, lora_request=lora)
    done = {name: [0, 0.0] for name in runs}
    names = list(runs)
    turn = 0
    with collections_paused():
        while any(engine.has_unfinished_requests() for engine, _ in runs.values()):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                engine = runs[name][0]
                if engine.has_unfinished_requests():
                    started = time.perf_counter()
                    deltas = engine.step()
                    done[name][1] += time.perf_counter() - started
                    done[name][0] += sum(len(d.new_token_ids) for d in deltas)
            turn += 1
    return done


def markdown(results: dict) -> str:
    lines = ["| configuration | output tok/s | cost vs base (median of rounds) | smallest .. largest |", "|---|---:|---:|---:|"]
    for name, run in results["runs"].items():
        low, high = run["spread"]
        lines.append(f"| {name} | {run['output_tok_s']:.1f} | {run['cost']:+.1%} | {low:+.1%} .. {high:+.1%} |")
    return "\n".join(lines)
