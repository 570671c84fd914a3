"""`banyan bench lora`: the throughput cost of serving LoRA adapters, side by side in one process.

Random PEFT adapters (rank --lora-rank, every q/k/v/o/gate/up/down projection) are written for the model's shape
to a temporary directory. Three configurations run the same prompts (ignore_eos, every request at once):

    base           LLM without LoRA
    lora-off-rows  LLM(enable_lora=True), every request on the base model: what enabling LoRA costs by itself
    mixed          the same LLM, request i on adapter i % --num-adapters: one batch of mixed adapters

Rounds rotate the order (as bench speculative does). tok/s sums tokens and seconds over the rounds; `cost` is the
median over rounds of 1 - tok/s / base tok/s within the round: load that drifts over minutes on a shared machine
moves the configurations of one round together, so the paired ratio is steadier than the totals (`spread` gives
its smallest and largest values).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from banyan.bench.workloads import random_prompts
from banyan.config import EngineConfig, LoRAConfig, ModelArch
from banyan.frontend.llm import LLM
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
        with_lora = LLM.from_config(config.replace(lora=lora))
        adapters = []
        for i in range(args.num_adapters):
            write_random_adapter(Path(tmp) / f"a{i}", base.engine.arch, args.lora_rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        prompts = random_prompts(args.num_prompts, args.input_len, args.output_len, base.engine.arch.vocab_size,
                                 seed=args.workload_seed)
        runs = {
            "base": (base, None),
            "lora-off-rows": (with_lora, None),
            "mixed": (with_lora, [adapters[i % len(adapters)] for i in range(len(prompts))]),
        }
        inputs = [{"prompt_token_ids": p.prompt_token_ids} for p in prompts]
        params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
        totals = {name: [0, 0.0] for name in runs}
        per_round: list[dict[str, float]] = []  # tok/s of each configuration, one dict per round
        for name, (llm, loras) in runs.items():  # warm-up: adapters loaded and resident, kernels touched
            llm.generate(inputs[: len(adapters)], params.clone(max_tokens=2), use_tqdm=False,
                         lora_request=None if loras is None else loras[: len(adapters)])
        names = list(runs)
        for r in range(args.rounds):
            per_round.append({})
            for name in names[r % len(names):] + names[: r % len(names)]:
                llm, loras = runs[name]
                started = time.perf_counter()
                outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
                seconds = time.perf_counter() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                totals[name][0] += tokens
                totals[name][1] += seconds
                per_round[-1][name] = tokens / seconds
    results = {}
    for name, (tokens, seconds) in totals.items():
        costs = sorted(1 - rates[name] / rates["base"] for rates in per_round)
        results[name] = {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
                         "cost": statistics.median(costs), "spread": [costs[0], costs[-1]],
                         "per_round_tok_s": [rates[name] for rates in per_round]}
    bench = {k: v for k, v in vars(args).items() if k != "func"}
    return {"bench": bench}, {"runs": results, "device": base.engine.device, "dtype": base.engine.dtype}


def markdown(results: dict) -> str:
    lines = ["| configuration | output tok/s | cost vs base (median of rounds) | smallest .. largest |", "|---|---:|---:|---:|"]
    for name, run in results["runs"].items():
        low, high = run["spread"]
        lines.append(f"| {name} | {run['output_tok_s']:.1f} | {run['cost']:+.1%} | {low:+.1%} .. {high:+.1%} |")
    return "\n".join(lines)
