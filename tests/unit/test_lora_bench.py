"""banyan bench lora on a tiny model: random PEFT adapters for the model's shape that banyan accepts, every
configuration run on the same prompts, a cost per configuration against the base model."""

from __future__ import annotations

import argparse

from banyan.bench.lora import markdown, run_lora, write_random_adapter
from banyan.checkpoint import open_checkpoint
from banyan.config_args import config_from_kwargs
from banyan.lora.adapter import TARGETS, read_adapter
from tests.factories import write_model_dir


def test_bench_lora_runs_every_configuration(tmp_path):
    write_model_dir(tmp_path / "model", "llama", seed=1)
    arch = open_checkpoint(str(tmp_path / "model")).arch
    write_random_adapter(tmp_path / "adapter", arch, rank=4, seed=0)
    assert read_adapter(tmp_path / "adapter", arch, max_rank=4).target_modules == sorted(TARGETS)
    config = config_from_kwargs({"model": str(tmp_path / "model"), "num_threads": 1, "block_size": 4})
    args = argparse.Namespace(num_adapters=2, lora_rank=4, num_prompts=4, input_len=8, output_len=3, rounds=2,
                              temperature=0.0, workload_seed=0)
    _, results = run_lora(config, args)
    runs = results["runs"]
    assert list(runs) == ["base", "lora-off-rows", "mixed"]
    assert all(run["output_tokens"] == 2 * 4 * 3 and len(run["per_round_tok_s"]) == 2 for run in runs.values())
    assert runs["base"]["cost"] == 0.0
    assert "| mixed |" in markdown(results)
