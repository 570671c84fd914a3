"""Configuration: one frozen dataclass per component, composed into EngineConfig.

Each field's docstring (the string below it) is its `--help` text in the CLI (banyan/config_args.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from banyan.errors import InvalidParameterError
from banyan.registry import UnknownChoiceError
from banyan.spec.config import SpeculativeConfig
from banyan.tools.formats import FORMATS as TOOL_FORMATS

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_CACHE_DTYPES = {"auto": 0, "float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}  # bytes of a value (0: it depends)
DEFAULT_CPU_KV_BYTES = 1 << 30
"""kv_cache_memory of a CPU model in a server of several models when none is given (one model's: runner/memory.py)."""


@dataclass(frozen=True)
class ModelArch:
    """The shape of a decoder-only transformer, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Build from a Hugging Face config.json dict (`architectures`, else known from `model_type`)."""
        by_model_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
        archs = cfg.get("architectures") or [by_model_type.get(cfg.get("model_type"), "")]
        arch = archs[0]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_qwen3 = arch == "Qwen3ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2/3 configs carry a sliding_window they use only when use_sliding_window says so
        use_sliding = cfg.get("use_sliding_window", not (is_qwen2 or is_qwen3))
        sliding = cfg.get("sliding_window") if use_sliding else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            sliding_window=int(sliding) if sliding else None,
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """rope_scaling, or transformers 5's rope_parameters, without the plain 'default' kind."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return dict(scaling, rope_type=kind)


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    """A local Hugging Face directory, a .gguf file, or an alias (default: smollm2-135m-instruct)."""
    tokenizer: str | None = None
    """A Hugging Face directory (or .gguf file) whose tokenizer and chat template replace the model's."""
    dtype: str = "auto"
    """Weights and activations: auto, float32, bfloat16 or float16 (auto: on a GPU the checkpoint's 16-bit dtype,
    bfloat16 for float32 checkpoints; on a CPU with AMX bfloat16 for 16-bit checkpoints; float32 otherwise, GGUF
    files included: banyan's integer kernels serve them)."""
    max_model_len: int | str | None = None
    """Longest prompt plus output, in tokens (default: the model's context length); auto: the longest context whose
    K/V fits the cache's budget for one request, at most the model's (logged at start-up)."""
    seed: int | None = 0
    """Seed for requests that bring no seed of their own (None: a fresh one each start, as vLLM's LLM takes it)."""
    device: str = "auto"
    """cpu, cuda or auto."""
    attention_backend: str = "auto"
    """Attention implementation: torch, triton or auto (auto: triton on a CUDA GPU where it runs, i.e. installed,
    importing, compute capability 8.0+ and 8.9+ with an fp8 KV cache, else torch with a warning saying why;
    torch on a CPU)."""
    num_threads: int | None = None
    """CPU threads for torch (default: the cores available)."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs for decode steps (GPU only; the CPU always runs eagerly)."""
    trust_remote_code: bool = False
    """Passed to transformers' AutoTokenizer for a Hugging Face directory (a tokenizer class the directory ships as
    code); banyan never imports model code, whatever the value. Hidden from the CLI: off unless set in Python."""
    structured_output_backend: str = "llguidance"
    """Grammar library for structured output: llguidance or xgrammar (loaded on the first constrained request)."""
    structured_output_cache_size: int = 512
    """Compiled grammars kept for reuse (least recently used dropped first; 512 MiB at most)."""
    structured_outputs_config: dict[str, Any] | None = None
    """Structured-output defaults, as JSON. {"disable_any_whitespace": false}: JSON outputs may put up to 16
    whitespace characters between tokens (default: none, compact JSON as OpenAI writes it). A request's own
    structured_outputs.disable_any_whitespace wins."""
    quantization: str | None = None
    """Weight-only quantization, done while loading: int8 (one scale per output channel), int4 (groups of
    --quantization-group-size inputs), fp8 (e4m3, per channel; torch._scaled_mm), fp16 (float16 weights, float32
    math: FBGEMM on x86 CPUs), gguf (keep a GGUF file's Q4_0/Q4_1/Q8_0 tensors compact instead of dequantizing
    them), awq, gptq or compressed-tensors (keep such a checkpoint's 4-bit / int8 layers as banyan's int4 / int8,
    the same values; any other value but none is refused for it), or none. Default: an AWQ/GPTQ/compressed-tensors
    checkpoint's own; for a float32 model on an x86 CPU: a GGUF file's tensors compact for decode (banyan's
    AVX2 kernel) with float16 copies for prefill where the CPU is AVX2-only, fp16 on AVX-512 CPUs; a bf16/fp16
    checkpoint in fp16 (nothing the file holds is lost); otherwise none. See docs/quantization.md."""
    quantization_group_size: int = 32
    """Inputs per int4 scale and zero: 32 (as GGUF's Q4 blocks), 64 or 128 (it must divide every layer's input
    size)."""
    batch_invariant: bool | None = None
    """Each request's output the same whatever else is in the batch and however its prompt is cut into chunks
    (as vLLM's VLLM_BATCH_INVARIANT): every matmul row and attention row goes through banyan's CPU kernels in one
    fixed order. Needs an x86 CPU with AVX2, a float32 model and none/fp16/int8/int4/gguf weights. Default: on where
    it was measured to cost at most 10% (x86 CPUs with AVX2 or AVX-512, float32/int8/int4 layers: the default GGUF
    mix 0-3% offline; no LoRA nor tensor/pipeline parallelism), off elsewhere; the log says why (quantization.md)."""
    pooling: str | None = None
    """How embedding requests pool the last hidden states: last (the last token's) or mean (over the input);
    default: the model's sentence-transformers pooling config (modules.json, 1_Pooling/config.json) when it has
    one, else last. The embedding is L2-normalised either way (docs/embeddings.md)."""
    reasoning_parser: str | None = None
    """Reasoning models: qwen3 or deepseek_r1. The text between the think markers is the reply's `reasoning`
    (chat: message.reasoning and reasoning deltas; /v1/responses: a reasoning item), the rest its content; a
    structured output or the tools' grammar applies only after the reasoning ends (docs/reasoning.md)."""

    def __post_init__(self):
        length = self.max_model_len
        if isinstance(length, str) and length != "auto" or isinstance(length, int) and length < 1:
            raise InvalidParameterError("max_model_len", f"must be a positive number of tokens or auto, got {length!r}")
        if self.num_threads is not None and self.num_threads < 0:  # 0 and None: the default
            raise InvalidParameterError("num_threads", f"must be a positive number of threads, got {self.num_threads}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV page."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache (default on CPU: what free memory leaves after the weights and a reserve, at most
    what max_num_seqs x max_model_len tokens fill; 1 GiB per model in a server of several; on GPU:
    gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory banyan may use, weights included."""
    num_pages: int | None = None
    """Exact number of KV pages (overrides the memory budget; for tests)."""
    enable_prefix_caching: bool = True
    """Reuse cached KV pages of any shared prompt prefix."""
    kv_cache_dtype: str = "auto"
    """KV cache storage: auto (the model's dtype, but float16 for a float32 model on a CPU, as llama.cpp), float32,
    float16, bfloat16, or fp8 (float8_e4m3fn, scale 1.0: half of bf16's memory, values beyond +-448 clamped)."""

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                        f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise InvalidParameterError("num_pages", f"must be at least 2, got {self.num_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidParameterError("gpu_memory_utilization", "must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens plus prefill chunks)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    policy: str = "fcfs"
    """fcfs (arrival order), priority (lower value first, then arrival) or slo (earliest time-to-first-token deadline
    first, fair across API keys; one that can no longer meet its targets: 503, Retry-After, docs/reliability.md)."""
    default_ttft_slo_ms: float | None = None
    """Time-to-first-token target of requests whose body sets no slo.ttft_ms (default: none)."""
    default_tpot_slo_ms: float | None = None
    """Time-per-output-token target of requests whose body sets no slo.tpot_ms (default: none)."""
    enable_jump_forward: bool = True
    """Structured output: append the tokens a grammar forces (JSON keys, punctuation) without a forward pass each."""
    shared_prefix_wait_tokens: int = 32
    """A new request waits to reuse what a prefill will cache if that is this many of its uncached tokens (0: never)."""
    async_scheduling: bool = False
    """Overlap scheduling: launch each step before reading the last one's sampled ids (for GPUs; docs/gpu.md)."""

    def __post_init__(self):
        for name, least in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("shared_prefix_wait_tokens", 0)):
            if getattr(self, name) < least:
                raise InvalidParameterError(name, f"must be >= {least}, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority", "slo"):
            raise InvalidParameterError("policy", f"must be fcfs, priority or slo, got {self.policy!r}")
        for name in ("default_ttft_slo_ms", "default_tpot_slo_ms"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise InvalidParameterError(name, f"must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT's layout) on top of the model: each request may run with its own (docs/lora.md)."""
    max_loras: int = 1
    """LoRA adapters resident at once, their weights preallocated; others are swapped in, least recently used out."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (every slot is sized for it)."""

    def __post_init__(self):
        if self.max_loras < 1:
            raise InvalidParameterError("max_loras", f"must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise InvalidParameterError("max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")


ROUTER_POLICIES = ("cache_aware", "round_robin", "least_load")
PARALLEL_BACKENDS = ("mp", "ray")  # vLLM's names: local processes, or Ray actors (banyan/distributed/ray_cluster.py)
RAY_CLIENT_REFUSED = (
    "ray:// (Ray Client) addresses are not supported: the engine cores Ray places connect back to sockets the server "
    "binds on its own node's address, so banyan must run on a node of the cluster; start it there and give the "
    "cluster's GCS address host:port (`ray start --head --port 6379` prints it), or leave it unset on a node that "
    "ran `ray start`")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Processes that each hold a slice of every layer (heads, MLP rows, vocabulary), one all-reduce after the
    attention and one after the MLP; gloo on CPU, NCCL on GPUs (docs/parallel.md)."""
    pipeline_parallel_size: int = 1
    """Processes that each hold a contiguous range of the layers (a stage); with tensor parallel T, T each."""
    pipeline_micro_batches: int | None = None
    """Micro-batches per step, so pipeline stages overlap; default: one per stage if each gets 64 tokens, else 1."""
    data_parallel_size: int = 1
    """Engine cores, each a whole copy of the model, behind one API server; a router picks one per request
    (banyan serve only)."""
    router_policy: str | None = None
    """How requests are routed over data-parallel replicas: cache_aware (the replica that most likely holds the
    prompt's prefix, unless load is unbalanced; the default), round_robin or least_load."""
    distributed_timeout: float = 60.0
    """Seconds a collective between tensor-parallel workers may wait before the engine fails (a worker that
    died or hung): the in-flight requests get an error and the server exits non-zero."""
    worker_fault: str | None = None
    """Tests only (runner/worker.py): hang-at-step=N or exit-at-step=N on worker rank 1."""
    data_parallel_backend: str = "mp"
    """Where engine cores run: mp (local processes) or ray (Ray actors on the nodes of a Ray cluster, one per node
    while nodes have room, each asking for its ranks' CPUs (--num-threads each) or one GPU per rank;
    pip install 'banyan[ray]'; docs/parallel.md)."""
    distributed_executor_backend: str = "mp"
    """Where tensor/pipeline-parallel workers run: mp (local processes) or ray (Ray actors in a placement group, on
    any nodes of a Ray cluster; pip install 'banyan[ray]')."""
    ray_address: str | None = None
    """The Ray cluster to join with a ray backend: its GCS address host:port (default: $RAY_ADDRESS, or else a
    one-node Ray started by this process)."""
    replicas_on_host: int | None = None
    """Data-parallel replicas sharing one host's memory, for sizing each CPU KV pool (set by the engine client, not
    a flag): None is all of them (local processes); with --data-parallel-backend ray, as many as Ray's spreading
    puts on a node (distributed/ray_cluster.replicas_per_node)."""

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "pipeline_micro_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidParameterError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.router_policy is not None and self.router_policy not in ROUTER_POLICIES:
            raise UnknownChoiceError("router_policy", self.router_policy, list(ROUTER_POLICIES))
        if not self.distributed_timeout > 0:
            raise InvalidParameterError("distributed_timeout", f"must be positive, got {self.distributed_timeout}")
        if self.ray_address is not None and self.ray_address.startswith("ray://"):
            raise InvalidParameterError("ray_address", RAY_CLIENT_REFUSED)
        if self.replicas_on_host is not None and not 1 <= self.replicas_on_host <= self.data_parallel_size:
            raise InvalidParameterError("replicas_on_host", f"must be 1..data_parallel_size "
                                        f"({self.data_parallel_size}), got {self.replicas_on_host}")
        for name in ("data_parallel_backend", "distributed_executor_backend"):
            if getattr(self, name) not in PARALLEL_BACKENDS:
                raise UnknownChoiceError(name, getattr(self, name), list(PARALLEL_BACKENDS))
            if getattr(self, name) == "ray" and importlib.util.find_spec("ray") is None:
                raise InvalidParameterError(name, "'ray' needs the Ray package, which is not installed: "
                                            "pip install 'banyan[ray]'")

    @property
    def on_ray(self) -> bool:
        """Whether any process (an engine core or a worker) is placed by Ray."""
        return "ray" in (self.data_parallel_backend, self.distributed_executor_backend)

    @property
    def processes(self) -> int:
        """Engine processes in all, each with weights and a KV pool of its own (replicas x ranks)."""
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size

    def pools_on_host(self, ranks_here: int | None = None) -> int:
        """Processes sizing a KV pool from this host's memory at the same time (runner/memory.py): the replicas on
        this host (replicas_on_host) x each one's ranks on it (ranks_here: counted from a Ray placement group; None:
        every rank, local processes). A replica or worker that Ray placed on another node sizes from that node's."""
        replicas = self.data_parallel_size if self.replicas_on_host is None else self.replicas_on_host
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size if ranks_here is None else ranks_here
        return replicas * ranks


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (`speculative_config`, vLLM's JSON object); None: off, every step is the plain path."""

    def replace(self, **sections: Any) -> EngineConfig:
        return dataclasses.replace(self, **sections)


def default_num_threads() -> int:
    """Cores this process may run on (macOS has no affinity: its CPU count)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return max(1, len(affinity(0)) if affinity else os.cpu_count() or 1)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 for every interface)."""
    port: int = 8000
    """Port to listen on."""
    served_model_name: str | None = None
    """Name(s) clients use for the model, comma-separated (default: the --model value)."""
    api_key: tuple[str, ...] = ()
    """API key clients must send as `Authorization: Bearer KEY` (repeatable; also BANYAN_API_KEY)."""
    api_key_file: str | None = None
    """A file with one API key per line."""
    admin_api_key: tuple[str, ...] = ()
    """Key for the admin routes (/admin/..., adapter loading, profiling); repeatable; also BANYAN_ADMIN_API_KEY.
    Without one, no admin route exists."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served from the start, as name=path (PEFT directories; needs --enable-lora): a request
    selects one by giving its name as `model`."""
    models: str | None = None
    """A YAML file listing the models to serve (name, model, engine_args, memory_share) and routes, instead of
    --model (docs/multi_model.md)."""
    memory_budget: int | None = None
    """Bytes all served models may hold together (weights + KV cache + their processes); a load beyond it is
    refused (default: the available RAM less a margin on CPU, --gpu-memory-utilization of the device on GPU)."""
    route: tuple[str, ...] = ()
    """An A/B or canary route, NAME=MODEL:WEIGHT,MODEL:WEIGHT (repeatable): requests for NAME go to one of the
    models by weight, sticky per user (docs/multi_model.md)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served from the start, as name=path (PEFT directories; needs --enable-lora): a request
    selects one by giving its name as `model`."""
    share_prefix_cache: bool = False
    """Let different API keys reuse each other's cached prompts (off: each key is its own cache namespace)."""
    protect_metrics: bool = False
    """Require an API key for /metrics too."""
    max_queued_requests: int = 1024
    """Requests in the engine (running + waiting) beyond which new ones get 503 with Retry-After."""
    requests_per_minute: int | None = None
    """Per-key request rate limit (429 with Retry-After beyond it)."""
    tokens_per_minute: int | None = None
    """Per-key limit on prompt + max_tokens tokens per minute."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (413 beyond it)."""
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM waits for in-flight requests before aborting them."""
    chat_template: str | None = None
    """A chat template (file path or inline Jinja) replacing the model's."""
    allow_request_chat_template: bool = False
    """Accept a `chat_template` field in requests (rendered sandboxed, with time and size caps)."""
    tool_call_parser: str = "auto"
    """How the model writes tool calls: auto (read from the chat template), hermes, llama3_json or json_list."""
    wedge_timeout: float = 30.0
    """Seconds without engine progress (while requests wait) after which /health reports 503."""
    render_timeout: float = 5.0
    """Seconds a chat template render or a tokenization may take before the request gets 400."""
    request_read_timeout: float = 30.0
    """Seconds a client may take to send a whole request, headers and body; a slower one (slowloris) is
    disconnected, with 408 when its headers never came."""
    response_write_timeout: float = 30.0
    """Seconds a response may wait on a client that reads nothing (its send buffer full) before the connection is
    dropped and its requests aborted."""
    max_buffered_events: int = 1024
    """Stream events held per choice for a client that reads slower than the model writes; beyond it the request
    is aborted."""
    responses_store_size: int = 1024
    """/v1/responses kept for previous_response_id and GET /v1/responses/{id}, over all API keys (the oldest go
    first; 0 keeps none). Each API key reads only its own."""
    responses_store_ttl: float = 3600.0
    """Seconds a stored response is kept."""
    vllm_metric_names: bool = True
    """Export every metric vLLM also has under its vLLM name too (vllm:..., same labels), beside banyan:..., so
    dashboards and alerts written for vLLM work unchanged."""
    log_format: str = "text"
    """Log lines of both processes (server and engine core) as plain text or as one JSON object per line (json)."""
    audit_log: bool = True
    """One line per API request on the banyan.audit logger: request id, key id (never the key), model, token
    counts, status, latency; never prompt or output text."""
    profile_dir: str | None = None
    """Directory for torch-profiler traces of the engine core (POST /start_profile, /stop_profile; admin key)."""

    def __post_init__(self):
        if self.tool_call_parser != "auto" and self.tool_call_parser not in TOOL_FORMATS:
            raise UnknownChoiceError("tool_call_parser", self.tool_call_parser, ["auto", *TOOL_FORMATS.names()])
        if self.log_format not in ("text", "json"):
            raise InvalidParameterError("log_format", f"must be text or json, got {self.log_format!r}")
        for name in ("request_read_timeout", "response_write_timeout", "max_buffered_events"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(name, f"must be positive, got {getattr(self, name)}")
