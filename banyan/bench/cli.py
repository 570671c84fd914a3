"""`banyan bench throughput | latency | overhead | speculative | lang | lora | swap | router | serve | compare`: argument parsing and dispatch."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Callable

from banyan.bench.plan import CompareConfig
from banyan.bench.results import emit, make_report
from banyan.bench.router import add_router_args
from banyan.bench.workloads import SPEC_WORKLOADS, WORKLOADS
from banyan.bench.deadlines import DeadlineBenchConfig
from banyan.bench.soak import SoakConfig
from banyan.config_args import add_config_args, add_engine_args, config_from_args, engine_config, engine_flags


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark banyan (offline, latency, overhead) or any OpenAI server")
    kinds = bench.add_subparsers(dest="bench", required=True)

    def add(name: str, help_text: str, run, engine: bool = True) -> argparse.ArgumentParser:
        parser = kinds.add_parser(name, help=help_text)
        parser.add_argument("--output-json", default=None, help="write the results JSON here")
        parser.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts")
        parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (vLLM's benchmarks use 1.0)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        if engine:
            add_engine_args(parser)
        parser.set_defaults(func=lambda args: _run(name, run, args))
        return parser

    tput = add("throughput", "offline requests/s and tokens/s through LLM.generate", _throughput)
    _workload_args(tput, input_len=128, output_len=128, num_prompts=64)

    lat = add("latency", "batch-1 time to first token and decode tokens/s", _latency)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3, help="timed runs after one warm-up")

    over = add("overhead", "scheduler + KV manager + sampler + detokenizer tokens/s with a zero-cost model", _overhead)
    over.add_argument("--batch-size", type=int, default=256)
    over.add_argument("--input-len", type=int, default=32)
    over.add_argument("--output-len", type=int, default=128, help="decode steps")

    spec = add("speculative", "output tok/s with speculation off and per method and policy, side by side", None)
    spec.add_argument("--workload", default="copy", choices=SPEC_WORKLOADS,
                      help="copy: rewrite-this-text prompts (chat-templated); code-edit: change-this-code prompts, each "
                           "stopping where its answer ends (up to twice its code's tokens); random: random prompts, "
                           "nothing to copy; mixed: half copy, half random, interleaved")
    spec.add_argument("--num-prompts", type=int, default=4)
    spec.add_argument("--copy-sentences", type=int, default=8, help="copy: sentences in each text to rewrite")
    spec.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    spec.add_argument("--output-len", type=int, default=None,
                      help="generated tokens (ignore_eos; default 64); code-edit: the most a request may generate "
                           "(default: twice its code's tokens, plus 16)")
    spec.add_argument("--batch-size", type=int, default=1, help="requests running at once (max_num_seqs)")
    spec.add_argument("--rounds", type=int, default=2, help="timed rounds, each running every configuration once")
    spec.add_argument("--methods", default="ngram,suffix", help="comma-separated speculative methods (ngram, suffix, "
                                                                "layer_skip, draft_model)")
    spec.add_argument("--draft-model", default=None, help="draft_model: the draft's checkpoint")
    spec.add_argument("--draft-quantization", default=None,
                      help="draft_model: how the draft's weights load (default: as the target's)")
    spec.add_argument("--policies", default="adaptive,fixed", help="comma-separated controller policies")
    spec.add_argument("--suffix-options", default=None,
                      help="suffix: speculative_config JSON its configurations add, e.g. "
                           "'{\"suffix_decoding_max_cached_requests\": 0}' (no memory of earlier requests' outputs)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None,
                      help="drafts per step at most (default: each configuration's own, as speculative_config's)")
    spec.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second, seeded by --workload-seed (inf: every prompt at once); "
                           "adds TTFT / TPOT / E2E latency per configuration")
    spec.set_defaults(temperature=None, func=_tabled("speculative"))  # None: greedy for copy, 1.0 for random

    lora = add("lora", "output tok/s of a batch mixing LoRA adapters vs the base model alone, side by side", None)
    lora.add_argument("--num-adapters", type=int, default=8, help="random adapters, request i on adapter i mod this")
    lora.add_argument("--lora-rank", type=int, default=16)
    lora.add_argument("--num-prompts", type=int, default=32, help="requests, all running at once")
    lora.add_argument("--input-len", type=int, default=128)
    lora.add_argument("--output-len", type=int, default=64, help="generated tokens (ignore_eos)")
    lora.add_argument("--rounds", type=int, default=3, help="timed rounds, each running every configuration once")
    lora.set_defaults(func=_tabled("lora"))

    swap = add("swap", "a model swapped under load on a server it starts: longest token gap, TTFT p50/p99 during "
                       "the swap vs before, failed requests", None)
    swap.add_argument("--swap-model", default=None, help="the source to swap to (default: the --model itself)")
    swap.add_argument("--concurrency", type=int, default=16, help="clients streaming back to back")
    swap.add_argument("--input-len", type=int, default=64)
    swap.add_argument("--output-len", type=int, default=32, help="generated tokens per request (ignore_eos)")
    swap.add_argument("--warmup-seconds", type=float, default=5.0)
    swap.add_argument("--before-seconds", type=float, default=20.0, help="the window measured before the swap")
    swap.add_argument("--after-seconds", type=float, default=2.0)
    swap.set_defaults(func=_tabled("swap", lambda results: bool(results["failed"] or results["swap_error"])))

    lang = add("lang", "banyan.lang programs: fork with the prefix cache off vs on, run_batch vs one by one, "
                       "OpenAICompatible vs RuntimeEndpoint on one server", None)
    lang.add_argument("--context-tokens", type=int, default=1024, help="fork: the shared context's tokens")
    lang.add_argument("--branches", type=int, default=8, help="fork: branches")
    lang.add_argument("--branch-tokens", type=int, default=64, help="fork: tokens each branch generates")
    lang.add_argument("--num-programs", type=int, default=64, help="batch: short programs")
    lang.add_argument("--program-tokens", type=int, default=16, help="batch and http: tokens each program generates")
    lang.add_argument("--http-programs", type=int, default=16, help="http: programs per run")
    lang.add_argument("--http-context-tokens", type=int, default=256, help="http: each program's context tokens")
    lang.add_argument("--rounds", type=int, default=1, help="timed rounds, each running both sides once")
    lang.add_argument("--no-http", action="store_true", help="skip the HTTP comparison (it starts a server)")
    lang.set_defaults(func=_tabled("lang"))

    router = add("router", "data-parallel replicas behind one server: each --router-policy on a multi-tenant "
                           "workload, prefix hit rate, TTFT, throughput", None)
    add_router_args(router)
    router.set_defaults(func=_tabled("router"))

    srv = add("serve", "load-test an OpenAI-compatible server over HTTP (streamed /v1/completions)", _serve, engine=False)
    srv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    srv.add_argument("--model", default=None, help="the model name to send (default: the server's)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--vocab-size", type=int, default=32000, help="random prompt token ids are drawn below this")
    srv.add_argument("--tokenizer", default=None, help="sharegpt: the model (alias, directory, .gguf) whose tokenizer to use")
    srv.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    srv.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    srv.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000")
    _workload_args(srv, input_len=128, output_len=128, num_prompts=64)

    cmp = kinds.add_parser("compare", help="banyan and the installed peers on the same workloads, one after the "
                                           "other; writes JSON, markdown and PNG plots")
    add_engine_args(cmp)
    add_config_args(cmp, "compare", CompareConfig)
    cmp.set_defaults(func=_compare)

    soak = kinds.add_parser("soak", help="a banyan server it starts, under random streamed traffic for a while, then a "
                                         "disconnect storm: lost/mangled responses, 5xx, RSS, fds, threads, KV pages")
    add_engine_args(soak)
    add_config_args(soak, "soak", SoakConfig)
    soak.add_argument("--output-dir", default="soak-results", help="soak.json, soak.md and soak.svg go here")
    soak.set_defaults(func=_soak)

    dl = kinds.add_parser("deadlines", help="goodput at 1.5x and 3x the measured capacity with a TTFT target: "
                                            "--scheduling-policy slo against fcfs, each on a server it starts")
    add_engine_args(dl)
    add_config_args(dl, "deadlines", DeadlineBenchConfig)
    dl.add_argument("--output-json", default=None, help="write the results JSON here")
    dl.set_defaults(func=_deadlines)


def _workload_args(parser: argparse.ArgumentParser, input_len: int, output_len: int, num_prompts: int) -> None:
    parser.add_argument("--workload", default="random", choices=WORKLOADS)
    parser.add_argument("--input-len", type=int, default=input_len,
                        help="prompt tokens (shared-prefix: the question; multi-turn: each user turn)")
    parser.add_argument("--output-len", type=int, default=output_len, help="generated tokens (ignore_eos)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help="requests (multi-turn: of all turns)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by this fraction")
    parser.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: requests per system prompt")
    parser.add_argument("--system-prompt-len", type=int, default=1024,
                        help="shared-prefix: shared tokens; multi-turn: the system prompt all conversations share (0: none)")
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    parser.add_argument("--sharegpt-path", default=None, help="sharegpt: a ShareGPT-format JSON file (never downloaded)")
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="sharegpt: generate this many tokens instead of each reply's length")


def _run(name: str, run, args: argparse.Namespace) -> int:
    config, results = run(args)
    emit(make_report(name, config, results), args.output_json)
    failed = results.get("failed", 0)
    return 1 if failed else 0


def _tabled(name: str, failed: Callable[[dict], bool] = lambda results: False) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose module banyan.bench.<name> has run_<name>(engine_config, args) -> (config, results) and
    markdown(results): run it, emit the report with its table; exit 1 when `failed(results)`."""

    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(f"banyan.bench.{name}")  # on use: a bench's imports load only for it
        config, results = getattr(module, f"run_{name}")(engine_config(args), args)
        emit(make_report(name, config, results), args.output_json, table=module.markdown(results))
        return 1 if failed(results) else 0

    return run


def _throughput(args):
    from banyan.bench.offline import run_throughput

    return run_throughput(engine_config(args), args)


def _latency(args):
    from banyan.bench.offline import run_latency

    return run_latency(engine_config(args), args)


def _overhead(args):
    from banyan.bench.offline import run_overhead

    return run_overhead(engine_config(args), args)


def _serve(args):
    from banyan.bench.metrics import parse_goodput
    from banyan.bench.serve import run_serve
    from banyan.bench.workloads import make_workload

    slos = parse_goodput(args.goodput)
    prompts = make_workload(args.workload, args, args.vocab_size, encode=_encoder(args.tokenizer))
    results = asyncio.run(run_serve(args.base_url, args.model, prompts, concurrency=args.concurrency,
                                    request_rate=args.request_rate, slos=slos, seed=args.workload_seed, api_key=args.api_key,
                                    progress=not args.no_progress))
    config = {"bench": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}}
    config["bench"]["request_rate"] = str(args.request_rate)  # inf is not JSON
    return config, results


def _compare(args) -> int:
    """Prints the report; exits 1 when a peer asked for was skipped or any run failed."""
    from banyan.bench.compare import run_compare
    from banyan.bench.compare_report import markdown, peer_failures

    report = run_compare(engine_config(args), config_from_args(CompareConfig, args))
    print(markdown(report))
    problems = peer_failures(report)
    for problem in problems:
        print(f"banyan bench compare: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _soak(args) -> int:
    """Writes the report; exits 1 when a goal was missed."""
    from pathlib import Path

    from banyan.bench.soak import run_soak
    from banyan.bench.soak_report import markdown, write_svg

    engine = engine_config(args)
    results = run_soak(engine, config_from_args(SoakConfig, args), on_progress=lambda m: print(m, file=sys.stderr))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_svg(results["soak"]["samples"], out / "soak.svg")
    report = make_report("soak", {"model": engine.model.model, "engine_flags": engine_flags(engine)}, results)
    (out / "soak.md").write_text(markdown(report), encoding="utf-8")
    emit(report, str(out / "soak.json"), table=markdown(report))
    return 0 if all(results["goals"].values()) else 1


def _deadlines(args) -> int:
    from banyan.bench.deadlines import markdown, run_deadlines

    engine, config = engine_config(args), config_from_args(DeadlineBenchConfig, args)
    results = run_deadlines(engine, config, on_progress=lambda m: print(m, file=sys.stderr))
    report = make_report("deadlines", {"model": engine.model.model, "engine_flags": engine_flags(engine)}, results)
    emit(report, args.output_json, table=markdown(results, config))
    return 0


def _encoder(model: str | None) -> Callable[[str], list[int]] | None:
    if model is None:
        return None
    from banyan.checkpoint import open_checkpoint

    return open_checkpoint(model).tokenizer.encode
