#!/usr/bin/env python3
"""The Python half of scripts/gpu_check.sh: engine greedy equality (triton vs torch), engine
throughput on a Llama-2-7B-shaped model with random bf16 weights, the transformers baseline, and the
summary table. Nothing is downloaded: the tiny model is written to a temp dir, the 7B one is built
from its config with random weights made on the device.

    python scripts/gpu_bench.py equality                          # tiny model, fp32 and bf16
    python scripts/gpu_bench.py throughput --backend triton       # 128 in / 128 out at 1, 16, 64, 256
    python scripts/gpu_bench.py hf                                # transformers generate, same shapes
    python scripts/gpu_bench.py table results.jsonl               # the short table
    ... --device cpu --tiny                                       # a smoke run on CPU (triton interpreted)

Each command prints one JSON object per result and appends it to --json when given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: banyan, tests.factories

LLAMA2_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=384, max_position_embeddings=512,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["equality", "throughput", "hf", "table"])
    p.add_argument("results", nargs="?", help="table: the JSON-lines file to summarise")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny model instead of Llama-2-7B's shape")
    p.add_argument("--backend", default="triton", choices=["torch", "triton"], help="throughput: attention backend")
    p.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=40.0, help="throughput: KV cache size")
    p.add_argument("--json", help="append each result as one JSON line to this file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.command == "table" and not args.results:
        p.error("table needs the results file")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything defines a triton kernel
    if args.command == "table":
        print(table([json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]))
        return
    for result in {"equality": equality, "throughput": throughput, "hf": hf_baseline}[args.command](args):
        line = json.dumps(result)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


# -- (2) greedy equality ---------------------------------------------------------------------------


def equality(args) -> list[dict]:
    """Greedy outputs of the tiny model under both backends: equal in fp32; bf16 is reported only
    (a different summation order may flip a near-tie)."""
    from banyan import LLM, SamplingParams
    from tests.factories import write_model_dir

    path = Path(tempfile.mkdtemp(prefix="banyan_tiny_"))
    vocab = write_model_dir(path, "llama", seed=1).config.vocab_size
    rng = random.Random(0)
    lengths = [3, 9, 20, 33] if args.tiny else [3, 9, 17, 33, 64, 100, 130, 200]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    prompts[1] = prompts[-1][:8] + prompts[1][8:]  # a shared prefix: the second run hits the cache
    params = SamplingParams(temperature=0.0, max_tokens=6 if args.tiny else 32, ignore_eos=True)
    results = []
    for dtype in ("float32", "bfloat16"):
        outputs = {}
        for backend in ("torch", "triton"):
            llm = LLM(str(path), device=args.device, dtype=dtype, attention_backend=backend, block_size=16,
                      num_pages=256, max_num_batched_tokens=64)  # small budget: mixed prefill + decode steps
            first = llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)
            rest = llm.generate([{"prompt_token_ids": p} for p in prompts[:-1]], params, use_tqdm=False)
            outputs[backend] = [o.outputs[0].token_ids for o in first + rest]
        equal = sum(a == b for a, b in zip(outputs["torch"], outputs["triton"]))
        results.append(dict(check="equality", dtype=dtype, equal=equal, sequences=len(prompts),
                            passed=equal == len(prompts) if dtype == "float32" else None))
    return results


# -- (3) engine throughput --------------------------------------------------------------------------


def throughput(args) -> list[dict]:
    import torch

    from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from banyan.engine.engine import Engine
    from banyan.sampling_params import SamplingParams

    shape = TINY if args.tiny else LLAMA2_7B
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    path = write_shell_model_dir(shape)
    use_random_weights(shape, args.device, getattr(torch, dtype))
    config = EngineConfig(
        model=ModelConfig(model=str(path), device=args.device, dtype=dtype, attention_backend=args.backend, seed=0),
        cache=CacheConfig(kv_cache_memory=int(args.kv_cache_gib * 2**30) if not args.tiny else 8 << 20),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192),
    )
    t0 = time.perf_counter()
    engine = Engine(config)
    startup = time.perf_counter() - t0
    run_batch(engine, 2, min(args.input_len, 16), 4, shape["vocab_size"], SamplingParams)  # warm-up: compiles kernels
    results = []
    for batch in args.batch_sizes:
        stats = run_batch(engine, batch, args.input_len, args.output_len, shape["vocab_size"], SamplingParams)
        results.append(dict(check="throughput", engine="banyan", backend=args.backend, model=model_name(args),
                            batch=batch, input_len=args.input_len, output_len=args.output_len,
                            startup_s=round(startup, 1), **stats))
    return results


def run_batch(engine, batch: int, input_len: int, output_len: int, vocab: int, SamplingParams) -> dict:
    """`batch` random prompts at once, greedy, ignore_eos; output tok/s, mean TTFT and ITL."""
    import torch

    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{start}", [rng.randrange(3, vocab) for _ in range(input_len)], params)
    first, last, tokens = {}, {}, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.new_token_ids:
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
                tokens += len(delta.new_token_ids)
    elapsed = time.perf_counter() - start
    ttft = statistics.mean(t - start for t in first.values())
    itl = statistics.mean((last[r] - first[r]) / max(1, output_len - 1) for r in first)
    return dict(output_tok_s=round(tokens / elapsed, 1), ttft_ms=round(ttft * 1e3, 1), itl_ms=round(itl * 1e3, 2),
                seconds=round(elapsed, 2), tokens=tokens)


def write_shell_model_dir(shape: dict) -> Path:
    """config.json + a real tokenizer + a one-tensor placeholder safetensors: enough for open_model.
    The weights themselves come from use_random_weights."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from tests.factories import make_tokenizer

    path = Path(tempfile.mkdtemp(prefix="banyan_shell_"))
    transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    make_tokenizer().save_pretrained(path)  # the engine never detokenizes here: ids beyond it are fine
    save_file({"placeholder": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def use_random_weights(shape: dict, device: str, dtype) -> None:
    """Make every ModelSource yield random weights of a Llama with `shape`, made on `device`."""
    import torch
    import transformers

    from banyan.runner import weights

    with torch.device("meta"):  # names and shapes only, no memory
        reference = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape))
    specs = [(name, t.shape) for name, t in reference.state_dict().items()]

    def iter_random(self):
        gen = torch.Generator(device).manual_seed(0)
        for name, size in specs:
            if len(size) == 1:  # norm weights
                yield name, torch.ones(size, dtype=dtype, device=device)
            else:
                yield name, (torch.randn(size, generator=gen, device=device) * 0.02).to(dtype)

    weights.ModelSource.iter_weights = iter_random


def model_name(args) -> str:
    return "tiny-llama" if args.tiny else "llama-2-7b-shaped (random bf16)"


# -- (4) transformers baseline -----------------------------------------------------------------------


def hf_baseline(args) -> list[dict]:
    import torch
    import transformers

    shape = TINY if args.tiny else LLAMA2_7B
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape), dtype=dtype).eval()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def generate(batch, input_len, output_len):
        gen = torch.Generator(args.device).manual_seed(batch)
        ids = torch.randint(3, shape["vocab_size"], (batch, input_len), generator=gen, device=args.device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=0)

    generate(2, 8, 4)  # warm-up
    results = []
    for batch in args.batch_sizes:
        sync()
        start = time.perf_counter()
        generate(batch, args.input_len, args.output_len)
        sync()
        elapsed = time.perf_counter() - start
        results.append(dict(check="throughput", engine="transformers", backend="sdpa", model=model_name(args),
                            batch=batch, input_len=args.input_len, output_len=args.output_len,
                            output_tok_s=round(batch * args.output_len / elapsed, 1), seconds=round(elapsed, 2)))
    return results


# -- the table ---------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    lines = ["| check | result |", "| --- | --- |"]
    for r in results:
        if r["check"] == "kernel_tests":
            lines.append(f"| kernel tests (rc {r['rc']}) | {r['summary']} |")
        elif r["check"] == "equality":
            verdict = {True: "PASS", False: "FAIL", None: "info"}[r["passed"]]
            lines.append(f"| greedy triton == torch, {r['dtype']} | {r['equal']}/{r['sequences']} sequences ({verdict}) |")
    rows = {}
    for r in results:
        if r["check"] == "throughput":
            rows.setdefault(r["batch"], {})[f"{r['engine']}/{r['backend']}"] = r
    if rows:
        columns = sorted({c for row in rows.values() for c in row})
        first = next(r for r in results if r["check"] == "throughput")
        lines += ["", f"{first['model']}: output tok/s, {first['input_len']} in / {first['output_len']} out"
                  " (banyan: mean TTFT ms / ITL ms)",
                  "| batch | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for batch in sorted(rows):
            cells = []
            for c in columns:
                r = rows[batch].get(c)
                extra = f" ({r['ttft_ms']:.0f} / {r['itl_ms']:.1f})" if r and "itl_ms" in r else ""
                cells.append(f"{r['output_tok_s']:,.0f}{extra}" if r else "-")
            lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
