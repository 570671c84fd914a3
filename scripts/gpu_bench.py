#!/usr/bin/env python3
"""The Python half of scripts/gpu_check.sh: engine greedy equality (triton vs torch, CUDA graphs vs
eager, fp8 KV), engine throughput on a Llama-2-7B-shaped model with random bf16 weights, the
transformers baseline, and the summary table. Nothing is downloaded: the tiny model is written to a
temp dir, the 7B one is built from its config with random weights made on the device.

    python scripts/gpu_bench.py equality                          # tiny model: the cases in EQUALITY
    python scripts/gpu_bench.py throughput --backend triton       # 128 in / 128 out at 1, 16, 64, 256, CUDA graphs
    python scripts/gpu_bench.py throughput --enforce-eager        # ... without CUDA graphs
    python scripts/gpu_bench.py throughput --kv-cache-dtype fp8   # ... with an fp8 KV cache
    python scripts/gpu_bench.py hf                                # transformers generate, same shapes
    python scripts/gpu_bench.py table results.jsonl               # the short table
    ... --device cpu --tiny                                       # a smoke run on CPU (triton interpreted)

Each command prints one JSON object per result and appends it to --json when given.
"""

from __future__ import annotations

import argparse
import json
import logging
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
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="throughput: KV cache size (default: sized by the profiling forward, 0.9 of the GPU)")
    p.add_argument("--enforce-eager", action="store_true", help="throughput: no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="throughput: KV cache dtype")
    p.add_argument("--json", help="append each result as one JSON line to this file")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.command == "table" and not args.results:
        p.error("table needs the results file")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("banyan.runner").setLevel(logging.INFO)  # the KV pool's size and the CUDA graphs, in log.txt
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


EQUALITY = [  # label, dtype, engine A, engine B, must be equal (True, "gpu": on a GPU only; else reported only)
    ("triton == torch", "float32", dict(attention_backend="torch"), dict(attention_backend="triton"), True),
    # a different summation order can flip a near-tie in bf16
    ("triton == torch", "bfloat16", dict(attention_backend="torch"), dict(attention_backend="triton"), False),
    ("CUDA graphs == eager, triton", "float32", dict(attention_backend="triton", enforce_eager=True),
     dict(attention_backend="triton"), True),
    # both backends quantize K/V to the same fp8 values (not the CPU interpreter: see kernels/kv_store.py)
    ("fp8 KV: triton == torch", "float32", dict(attention_backend="torch", kv_cache_dtype="fp8"),
     dict(attention_backend="triton", kv_cache_dtype="fp8"), "gpu"),
    ("fp8 KV == auto KV, triton", "bfloat16", dict(attention_backend="triton"),
     dict(attention_backend="triton", kv_cache_dtype="fp8"), False),
]


def equality(args) -> list[dict]:
    """Greedy outputs of the tiny model under the two engines of each EQUALITY case."""
    from banyan import LLM, SamplingParams
    from tests.factories import write_model_dir

    path = Path(tempfile.mkdtemp(prefix="banyan_tiny_"))
    vocab = write_model_dir(path, "llama", seed=1).config.vocab_size
    rng = random.Random(0)
    lengths = [3, 9, 20, 33] if args.tiny else [3, 9, 17, 33, 64, 100, 130, 200]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    prompts[1] = prompts[-1][:8] + prompts[1][8:]  # a shared prefix: the second run hits the cache
    params = SamplingParams(temperature=0.0, max_tokens=6 if args.tiny else 32, ignore_eos=True)

    def run(dtype, engine):
        llm = LLM(str(path), device=args.device, dtype=dtype, block_size=16, num_pages=256, max_num_seqs=16,
                  max_num_batched_tokens=64, **engine)  # small budget: mixed prefill + decode steps
        first = llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[:-1]], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in first + rest]

    results = []
    for label, dtype, a, b, must in EQUALITY:
        equal = sum(x == y for x, y in zip(run(dtype, a), run(dtype, b)))
        required = must is True or (must == "gpu" and args.device == "cuda")
        results.append(dict(check="equality", label=label, dtype=dtype, equal=equal, sequences=len(prompts),
                            passed=equal == len(prompts) if required else None))
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
    kv_bytes = 8 << 20 if args.tiny else None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30)
    config = EngineConfig(
        model=ModelConfig(model=str(path), device=args.device, dtype=dtype, attention_backend=args.backend, seed=0,
                          enforce_eager=args.enforce_eager),
        cache=CacheConfig(kv_cache_memory=kv_bytes, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192),
    )
    t0 = time.perf_counter()
    engine = Engine(config)
    startup = time.perf_counter() - t0
    run_batch(engine, 2, min(args.input_len, 16), 4, shape["vocab_size"], SamplingParams)  # warm-up: compiles kernels
    results = []
    for batch in args.batch_sizes:
        stats = run_batch(engine, batch, args.input_len, args.output_len, shape["vocab_size"], SamplingParams)
        results.append(dict(check="throughput", engine="banyan", backend=variant(args, engine), model=model_name(args),
                            batch=batch, input_len=args.input_len, output_len=args.output_len,
                            startup_s=round(startup, 1), load_s=round(engine.runner.load_seconds, 2),
                            kv_tokens=engine.runner.capacity.num_tokens, **stats))
    return results


def variant(args, engine) -> str:
    """The column name: backend, CUDA graphs or eager (as the engine ran, after any fallback), KV dtype."""
    runner = engine.runner
    mode = "graphs" if runner.decode_graphs is not None else "eager"
    return f"{runner.attn.name} {mode}" + (" fp8-kv" if args.kv_cache_dtype == "fp8" else "")


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

    def iter_random(self, *_, **__):  # the loader's options (compact, shard, device) do not apply here
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
            label = r.get("label", "triton == torch")
            lines.append(f"| greedy {label}, {r['dtype']} | {r['equal']}/{r['sequences']} sequences ({verdict}) |")
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
        lines += startup_table(results)
    return "\n".join(lines)


def startup_table(results: list[dict]) -> list[str]:
    """Per banyan column: engine start-up (weights, memory profile, CUDA graph capture), of which loading the
    weights, and the KV pool's tokens."""
    firsts = {}
    for r in results:
        if r["check"] == "throughput" and "startup_s" in r:
            firsts.setdefault(r["backend"], r)
    lines = ["", "| banyan | start-up s | weights loaded in s | KV cache tokens |", "|---|---|---|---|"]
    return lines + [f"| {c} | {r['startup_s']} | {r.get('load_s', '-')} | {r['kv_tokens']:,} |"
                    for c, r in sorted(firsts.items())]


if __name__ == "__main__":
    main()
