#!/usr/bin/env python3
"""The Python half of scripts/gpu_check.sh: engine greedy equality (triton vs torch, CUDA graphs vs
eager, piecewise graphs, fp8 KV), fp8 weights' next-token agreement with bf16, the weights' load time,
engine throughput on a Llama-2-7B-shaped model with random bf16 weights, the transformers baseline, and
the summary table. Nothing is downloaded: the tiny model is written to a temp dir, the 7B one is built
from its config with random weights made on the device (`load` writes a real bf16 checkpoint first).

    python scripts/gpu_bench.py equality                          # tiny model: the cases in EQUALITY, fp8 agreement
    python scripts/gpu_bench.py load                              # a bf16 safetensors checkpoint read onto the GPU
    python scripts/gpu_bench.py throughput                        # 128 in / 128 out at 1, 16, 64, 256: auto
                                                                  # backend, CUDA graphs (decode + piecewise)
    python scripts/gpu_bench.py throughput --enforce-eager        # ... without CUDA graphs
    python scripts/gpu_bench.py throughput --no-piecewise         # ... decode-only steps' graphs alone
    python scripts/gpu_bench.py throughput --kv-cache-dtype fp8   # ... with an fp8 KV cache
    python scripts/gpu_bench.py throughput --quantization fp8     # ... with fp8 weights (per channel, _scaled_mm)
    python scripts/gpu_bench.py throughput --async-scheduling     # ... each step launched before the last is read
    python scripts/gpu_bench.py hf                                # transformers generate, same shapes
    python scripts/gpu_bench.py speculative                       # speculation off / adaptive / fixed k=5 side by
                                                                  # side: batch 1, 16 and 64 streams, a mixed batch
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
from collections.abc import Iterator
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
    p.add_argument("command", choices=["equality", "load", "throughput", "hf", "speculative", "table"])
    p.add_argument("results", nargs="?", help="table: the JSON-lines file to summarise")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny model instead of Llama-2-7B's shape")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="throughput: attention backend")
    p.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="throughput: KV cache size (default: sized by the profiling forward, 0.9 of the GPU)")
    p.add_argument("--enforce-eager", action="store_true", help="throughput: no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="throughput: KV cache dtype")
    p.add_argument("--no-piecewise", action="store_true", help="throughput: CUDA graphs for decode-only steps only")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"], help="throughput: weights")
    p.add_argument("--async-scheduling", action="store_true", help="throughput: overlap scheduling (docs/gpu.md)")
    p.add_argument("--agreement-model", help="equality: a real checkpoint (HF dir) for the fp8 agreement, whose "
                   "logits are not a random model's near-ties (default: the tiny random model)")
    p.add_argument("--load-layers", type=int, default=8, help="load: layers of the 7B shape written (8: 3.3 GiB)")
    p.add_argument("--spec-prompts", type=int, default=2, help="speculative: prompts of the batch-1 runs")
    p.add_argument("--spec-rounds", type=int, default=2, help="speculative: timed rounds of each scenario")
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
    commands = {"equality": equality, "load": load_time, "throughput": throughput, "hf": hf_baseline,
                "speculative": speculative}
    for result in commands[args.command](args):
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
    # the torch backend is not graph-safe: its steps all go through the piecewise graphs
    ("piecewise graphs == eager, torch", "float32", dict(attention_backend="torch", enforce_eager=True),
     dict(attention_backend="torch"), True),
    # the next step launched before the last one's ids are read: its placeholders filled on the device
    ("async scheduling == plain, auto", "float32", {}, dict(async_scheduling=True), True),
    ("CUDA graphs == eager, auto, fp8 weights + fp8 KV", "float32",
     dict(quantization="fp8", kv_cache_dtype="fp8", enforce_eager=True), dict(quantization="fp8", kv_cache_dtype="fp8"),
     False),  # _scaled_mm's kernel may follow the padded row count: last bits, reported only
]
AGREEMENT_GOAL = 0.97  # fp8 weights' teacher-forced top-1 next token against bf16's (issue 20)


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
    if args.agreement_model:
        path, prompts = Path(args.agreement_model), text_prompts(Path(args.agreement_model))
    return results + [agreement(args, path, prompts)]


def text_prompts(model_dir: Path, count: int = 4, length: int = 128) -> list[list[int]]:
    """Real text for a real model: this repository's docs/architecture.md in its tokens, `count` pieces."""
    import transformers

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def agreement(args, path: Path, prompts: list[list[int]]) -> dict:
    """fp8 weights against bf16 on the same text: at each prompt position, whether both predict the same top-1
    next token (teacher-forced: both read the same prefix, so one flip does not carry on)."""
    from banyan import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1)

    def top1(quantization):
        llm = LLM(str(path), device=args.device, dtype="bfloat16", block_size=16, num_pages=256, max_num_seqs=16,
                  max_num_batched_tokens=64, quantization=quantization)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[next(t for t, lp in entry.items() if lp.rank == 1) for entry in o.prompt_logprobs[1:]] for o in outs]

    pairs = [(a, b) for x, y in zip(top1("none"), top1("fp8")) for a, b in zip(x, y)]
    share = sum(a == b for a, b in pairs) / len(pairs)
    label = f"fp8 weights vs bf16, teacher-forced top-1 ({path.name if args.agreement_model else 'tiny random'})"
    return dict(check="agreement", label=label, positions=len(pairs),
                share=round(share, 4), goal=AGREEMENT_GOAL, passed=share >= AGREEMENT_GOAL)


# -- the weights' load time ------------------------------------------------------------------------------


def load_time(args) -> list[dict]:
    """A bf16 safetensors checkpoint of the 7B shape's first --load-layers layers (the tiny shape with --tiny),
    written to a temp dir and loaded by an engine: the runner's own timing (read onto the device, copied into
    the parameters), so GiB/s. The file was just written: it is read from the page cache, not the disk."""
    import torch
    import transformers

    from banyan.config import CacheConfig, EngineConfig, ModelConfig
    from banyan.engine.engine import Engine

    shape = dict(TINY if args.tiny else LLAMA2_7B)
    if not args.tiny:
        shape["num_hidden_layers"] = args.load_layers
    path = write_shell_model_dir(shape)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    gib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**30
    del model
    config = EngineConfig(model=ModelConfig(model=str(path), device=args.device, dtype="bfloat16",
                                            quantization="none", enforce_eager=True),
                          cache=CacheConfig(kv_cache_memory=64 << 20))
    seconds = Engine(config).runner.load_seconds
    return [dict(check="load", model=f"{model_name(args)}, {shape['num_hidden_layers']} layers", gib=round(gib, 2),
                 load_s=round(seconds, 2), gib_per_s=round(gib / seconds, 2))]


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
                          enforce_eager=args.enforce_eager, quantization=args.quantization),
        cache=CacheConfig(kv_cache_memory=kv_bytes, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192,
                                  async_scheduling=args.async_scheduling),
    )
    t0 = time.perf_counter()
    engine = Engine(config)
    startup = time.perf_counter() - t0
    if args.no_piecewise:  # to measure what the piecewise graphs bring: mixed steps eager again
        engine.runner.piecewise = None
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
    """The column name: backend (as the engine chose it, after any fallback), which CUDA graphs ran (decode-only
    steps whole, the others piecewise), fp8 weights, fp8 KV, async scheduling."""
    runner = engine.runner
    graphs = [name for name, on in (("decode", runner.decode_graphs), ("piecewise", runner.piecewise)) if on]
    mode = "+".join(graphs) + " graphs" if graphs else "eager"
    extras = (" fp8-w" if args.quantization == "fp8" else "") + (" fp8-kv" if args.kv_cache_dtype == "fp8" else "")
    extras += " async" if engine.overlap is not None else ""
    return f"{runner.attn.name} {mode}{extras}"


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


def hf_baseline(args) -> Iterator[dict]:
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
    for batch in args.batch_sizes:  # each result printed as it comes: a step cut by its time limit keeps the rest
        sync()
        start = time.perf_counter()
        generate(batch, args.input_len, args.output_len)
        sync()
        elapsed = time.perf_counter() - start
        yield dict(check="throughput", engine="transformers", backend="sdpa", model=model_name(args),
                   batch=batch, input_len=args.input_len, output_len=args.output_len,
                   output_tok_s=round(batch * args.output_len / elapsed, 1), seconds=round(elapsed, 2))


# -- (6) speculative decoding (issue 13) ------------------------------------------------------------------

SPEC_CONFIGS = {  # label -> speculative_config; "off" first: every ratio is over it
    "off": None,
    "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": 5, "policy": "adaptive"},
    "suffix-adaptive": {"method": "suffix", "num_speculative_tokens": 5, "policy": "adaptive"},
    "ngram-fixed5": {"method": "ngram", "num_speculative_tokens": 5, "policy": "fixed"},
    # the same adaptive ones proposing every step, as before the proposal budget (speculator.PROPOSAL_SHARE)
    "ngram-adaptive-every-pass": {"method": "ngram", "num_speculative_tokens": 5, "policy": "adaptive"},
    "suffix-adaptive-every-pass": {"method": "suffix", "num_speculative_tokens": 5, "policy": "adaptive"},
}


def speculative(args) -> Iterator[dict]:
    """The issue's three measurements on the 7B-shaped model, each configuration an engine of its own, side by side
    in rounds (banyan.bench.speculative.side_by_side): batch 1 greedy (random weights: what there is to copy is the
    loops greedy decoding falls into, not a rewrite; the acceptance is reported beside the ratio), 16 and 64 streams
    sampled at temperature 1 (nothing to copy: adaptive must turn itself off, >= 0.98x), and 16 streams half greedy,
    half sampled. Also each engine's start-up step-time model (seconds of a forward by tokens in it): on a GPU the
    cost of a verify pass's extra rows, which the speed-up at batch 1 turns on."""
    import dataclasses

    import torch

    from banyan.bench.speculative import side_by_side
    from banyan.bench.workloads import random_prompts
    from banyan.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from banyan.frontend.llm import LLM
    from banyan.spec.config import SpeculativeConfig

    shape = TINY if args.tiny else LLAMA2_7B
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    path = write_shell_model_dir(shape)
    use_random_weights(shape, args.device, getattr(torch, dtype))
    kv_bytes = (8 << 20) if args.tiny else int((args.kv_cache_gib or 4) * 2**30)  # six engines share the GPU
    llms = {}
    for label, spec in SPEC_CONFIGS.items():
        config = EngineConfig(
            model=ModelConfig(model=str(path), device=args.device, dtype=dtype, seed=0),
            cache=CacheConfig(kv_cache_memory=kv_bytes),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192),
            speculative=SpeculativeConfig.from_dict(spec) if spec else None)
        llms[label] = LLM.from_config(config)
        if label.endswith("every-pass"):
            llms[label].engine.speculator.proposal_share = float("inf")  # never skips a pass
    out_len, vocab = args.output_len, shape["vocab_size"]

    def prompts(count, temperature, seed):
        return [dataclasses.replace(p, temperature=temperature)
                for p in random_prompts(count, args.input_len, out_len, vocab, seed=seed)]

    half = prompts(8, 0.0, 3) + prompts(8, 1.0, 4)
    scenarios = [("batch 1, greedy", 1, prompts(args.spec_prompts, 0.0, 1)),
                 ("16 streams, temperature 1", 16, prompts(16, 1.0, 2)),
                 ("64 streams, temperature 1", 64, prompts(64, 1.0, 2)),
                 ("16 streams, half greedy, half temperature 1", 16,
                  [p for pair in zip(half[:8], half[8:]) for p in pair])]
    try:
        for label, llm in llms.items():
            speculator = llm.engine.speculator
            if speculator is not None:
                model = speculator.controller.step_time
                yield dict(check="spec_step_time", config=label, model=model_name(args),
                           points=[[t, round(s * 1e3, 3)] for t, s in zip(model.tokens, model.seconds)])
        for name, streams, batch in scenarios:
            for llm in llms.values():  # the scheduler admits `streams` at once; the engines were built for 64
                scheduler = llm.engine.scheduler
                scheduler.config = dataclasses.replace(scheduler.config, max_num_seqs=streams)
            runs = side_by_side(llms, batch, args.spec_rounds, temperature=0.0)  # each prompt's own temperature
            for label, r in runs.items():
                controller = llms[label].engine.speculator and llms[label].engine.speculator.controller
                yield dict(check="speculative", scenario=name, config=label, model=model_name(args),
                           input_len=args.input_len, output_len=out_len,
                           output_tok_s=round(r["output_throughput"], 1), ratio=round(r["ratio"], 3),
                           ratio_median=round(r["ratio_median"], 3),
                           mean_accepted_len=round(r.get("mean_accepted_len", 1.0), 2),
                           acceptance_per_pos=[round(a, 3) for a in r.get("acceptance_per_pos", [])],
                           num_drafts=r.get("num_drafts", 0),
                           # what the controller learned: s per sequence past the first, j per verifying step (ms)
                           seq_ms=round(controller.seq_seconds * 1e3, 3) if controller else None,
                           verify_ms=round(controller.verify_seconds * 1e3, 3) if controller else None)
    finally:
        for llm in llms.values():
            llm.engine.close()


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
        elif r["check"] == "agreement":
            verdict = "PASS" if r["passed"] else "FAIL"
            lines.append(f"| {r['label']} | {r['share']:.1%} of {r['positions']} positions, goal "
                         f"{r['goal']:.0%} ({verdict}) |")
        elif r["check"] == "load":
            lines.append(f"| weights load, bf16 safetensors -> device ({r['model']}) | {r['gib']} GiB in "
                         f"{r['load_s']} s = {r['gib_per_s']} GiB/s |")
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
    return "\n".join(lines + speculative_table(results))


def speculative_table(results: list[dict]) -> list[str]:
    """Per scenario and configuration: output tok/s, its ratio over `off` (summed over rounds; median of the rounds'),
    mean accepted length and acceptance per position; then the start-up step-time models."""
    spec = [r for r in results if r["check"] == "speculative"]
    if not spec:
        return []
    lines = ["", f"speculative decoding, {spec[0]['model']}, {spec[0]['input_len']} in / {spec[0]['output_len']} out",
             "| scenario | config | output tok/s | ratio (median) | mean accepted length | acceptance per position "
             "| learned s / j (ms) |", "|---|---|---|---|---|---|---|"]
    for r in spec:
        accept = " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"]) or "-"
        learned = f"{r['seq_ms']:.3f} / {r['verify_ms']:.3f}" if r.get("seq_ms") is not None else "-"
        lines.append(f"| {r['scenario']} | {r['config']} | {r['output_tok_s']:,.0f} | {r['ratio']:.2f}x "
                     f"({r['ratio_median']:.2f}x) | {r['mean_accepted_len']:.2f} | {accept} | {learned} |")
    for r in results:
        if r["check"] == "spec_step_time":
            points = ", ".join(f"{t}: {ms:.2f}" for t, ms in r["points"])
            lines.append(f"\nstep time at start-up, {r['config']} (tokens: ms): {points}")
    return lines


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
