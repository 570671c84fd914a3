"""The naive baseline users start from: transformers' generate() with static batching.

Prompts go in batches of batch_size, left-padded to the batch's longest; each batch runs until its
longest output is done (min_new_tokens = max_new_tokens stands in for ignore_eos). Greedy or
sampled as asked. Output is counted from what generate() returned: each row's new tokens, at most
as many as its prompt asked for (a shorter row's extra tokens are the batch's padding work).
"""

from __future__ import annotations

import time
from pathlib import Path

from banyan.bench.workloads import BenchPrompt, turns


def run_transformers(model_dir: Path, prompts: list[BenchPrompt], *, batch_size: int, temperature: float,
                     num_threads: int | None, progress: bool = True, dtype: str = "float32") -> tuple[int, float]:
    """(output tokens, seconds) of generating every prompt in `dtype` (float32 or bfloat16); the model's load time
    is not counted."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    batches = [turn[i : i + batch_size] for turn in turns(prompts) for i in range(0, len(turn), batch_size)]
    start = time.perf_counter()
    generated = 0
    for batch in tqdm(batches, desc="transformers batches", unit="batch", disable=not progress):
        generated += _generate_batch(model, batch, temperature)
    elapsed = time.perf_counter() - start
    return generated, elapsed


def _generate_batch(model, batch: list[BenchPrompt], temperature: float) -> int:
    """Generate one static batch; returns the output tokens counted (see the module docstring)."""
    import torch

    input_ids, attention_mask = left_pad([p.prompt_token_ids for p in batch], pad_id=0)
    new_tokens = max(p.output_len for p in batch)
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, **sampling)
    num_new = out.shape[1] - input_ids.shape[1]
    return sum(min(p.output_len, num_new) for p in batch)


def left_pad(rows: list[list[int]], pad_id: int):
    """[batch, longest] ids and attention mask, padding on the left so every row ends at the last column."""
    import torch

    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, longest - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, longest - len(row) :] = 1
    return ids, mask
