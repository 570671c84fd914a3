"""Memory accounting for the models of one server: estimate a model before its core starts, refuse what will not fit.

    estimate  = weights      parameters (from the checkpoint's shape) x bytes each as the core will hold them
              + KV cache     kv_cache_memory (num_pages x page x bytes per token when set; on CPU by default
                             $BANYAN_CPU_KV_CACHE_MEMORY, else 1 GiB: pinned so for each model of a server of several)
              + process      the core process itself (python + torch, measured 320 MiB on CPU), plus a GGUF file
                             (read through mmap while loading)

    budget    --memory-budget (bytes for all models together), or by default:
                CPU: what is available now (MemAvailable, or a cgroup limit less usage: host_memory.py) less a
                     reserve, less what loaded models may still grow into (their estimate above what they hold now)
                GPU: --gpu-memory-utilization of the device (nvidia-smi), less the loaded models' estimates

A model counts its estimate, or what its core holds (RSS) when that is more, from the moment its load is
accepted until its core has exited. Everything here runs in the API server: no torch.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from banyan.config import DEFAULT_CPU_KV_BYTES, KV_CACHE_DTYPES, EngineConfig, ModelArch
from banyan.errors import InvalidRequestError
from banyan.host_memory import cpu_kv_from_env, read_host_memory

MiB, GiB = 1 << 20, 1 << 30
CORE_PROCESS_BYTES = 320 * MiB
"""An engine core's own footprint on CPU: python, torch and banyan imported (a tiny model's core: 324 MiB RSS)."""


class MemoryBudgetExceededError(InvalidRequestError):
    """A model would not fit next to the models already loaded; nothing was started."""

    status = 409
    code = "memory_budget_exceeded"


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    process: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.process

    def describe(self) -> str:
        return (f"{gib(self.total)} (weights {gib(self.weights)} + KV cache {gib(self.kv_cache)} + "
                f"process {gib(self.process)})")


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def num_parameters(arch: ModelArch) -> int:
    """Parameters of a decoder-only model of this shape (embeddings, attention, gated MLP, norms)."""
    h, heads, kv, d, inter = (arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads,
                              arch.head_dim, arch.intermediate_size)
    attention = h * heads * d * 2 + h * kv * d * 2
    biases = ((heads + 2 * kv) * d if arch.attention_bias else 0) + (h if arch.o_proj_bias else 0)
    biases += 2 * inter + h if arch.mlp_bias else 0
    layer = attention + biases + 3 * h * inter + 2 * h + (2 * d if arch.qk_norm else 0)
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return embeddings + arch.num_hidden_layers * layer + h


def estimate_memory(engine: EngineConfig, arch: ModelArch, path: Path, on_gpu: bool) -> MemoryEstimate:
    """What a core serving this model will hold, before it starts (an upper bound where the dtype is chosen later)."""
    params = num_parameters(arch)
    file_bytes = checkpoint_bytes(path)
    is_gguf = path.is_file()
    weights = params * _bytes_per_parameter(engine, arch, is_gguf, on_gpu)
    if is_gguf and engine.model.quantization in (None, "gguf") and not on_gpu:
        weights = file_bytes + (2 * params if engine.model.quantization is None else 0)  # compact + fp16 copies
    # Data parallel: that many whole copies, those on this host (Ray may place the others on other nodes); tensor and
    # pipeline parallel: the weights split, but each rank its own KV budget (its part of every page) and process.
    parallel = engine.parallel
    replicas = parallel.replicas_on_host or parallel.data_parallel_size
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    return MemoryEstimate(int(weights) * replicas, kv_cache_bytes(engine, arch, on_gpu) * ranks * replicas,
                          ((0 if on_gpu else CORE_PROCESS_BYTES) * ranks + (file_bytes if is_gguf else 0)) * replicas)


def _bytes_per_parameter(engine: EngineConfig, arch: ModelArch, is_gguf: bool, on_gpu: bool) -> float:
    quantization = engine.model.quantization
    if quantization in ("int8", "fp8"):
        return 1.0
    if quantization == "int4":
        return 0.625  # 4 bits + a float16 scale and zero per group of 32
    dtype = engine.model.dtype
    if dtype in ("bfloat16", "float16") or quantization == "fp16" or on_gpu:
        return 2.0
    if dtype == "auto" and quantization is None and (is_gguf or arch.torch_dtype in ("bfloat16", "float16")):
        return 2.0  # the CPU default keeps 16-bit checkpoints in float16 (docs/quantization.md)
    return 4.0


def kv_cache_bytes(engine: EngineConfig, arch: ModelArch, on_gpu: bool) -> int:
    cache = engine.cache
    if cache.num_pages is not None:
        dtype_bytes = KV_CACHE_DTYPES[cache.kv_cache_dtype] or (4 if on_gpu and engine.model.dtype == "float32" else 2)
        return cache.num_pages * cache.block_size * arch.kv_bytes_per_token(dtype_bytes)
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    return 0 if on_gpu else cpu_default_kv_bytes()  # GPU: what --gpu-memory-utilization leaves (the budget's own rule)


def cpu_default_kv_bytes() -> int:
    """A CPU model's pool in a server that budgets several: $BANYAN_CPU_KV_CACHE_MEMORY, else 1 GiB. Not sized from
    free memory: their cores start at once, and each would count the memory the others are about to take."""
    fixed = cpu_kv_from_env()
    return DEFAULT_CPU_KV_BYTES if fixed is None else fixed


def gpu_cache_by_utilization(estimate: MemoryEstimate, utilization: float) -> MemoryEstimate:
    """A GPU core without kv_cache_memory takes for its KV cache what `utilization` of the device leaves after its
    weights: count that, so that a second such model is refused instead of running out of memory."""
    total = gpu_total_bytes()
    if total is None:
        return estimate
    return dataclasses.replace(estimate, kv_cache=max(0, int(total * utilization) - estimate.weights))


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the weights on disk: a .gguf file, or a directory's *.safetensors."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# -- the budget ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Holding:
    """A model that holds (or may grow to hold) memory: its estimate and what its core holds now."""

    name: str
    estimate: int
    resident: int = 0

    @property
    def accounted(self) -> int:
        return max(self.estimate, self.resident)


class MemoryBudget:
    """Decides whether one more model fits; `budget`: --memory-budget in bytes (None: the device's default)."""

    def __init__(self, budget: int | None, gpu_memory_utilization: float = 0.9):
        self.budget = budget
        self.gpu_memory_utilization = gpu_memory_utilization

    def check(self, name: str, need: MemoryEstimate, holding: list[Holding], on_gpu: bool) -> None:
        """Raise MemoryBudgetExceededError naming the numbers when `need` does not fit beside `holding`."""
        used = sum(h.accounted for h in holding)
        if self.budget is not None:
            free, what = self.budget - used, f"--memory-budget {gib(self.budget)}"
        elif on_gpu:
            total = gpu_total_bytes()
            if total is None:
                return  # no way to read the device without torch here: the core's own sizing decides
            limit = int(total * self.gpu_memory_utilization)
            free, what = limit - used, f"--gpu-memory-utilization {self.gpu_memory_utilization} of {gib(total)}"
        else:
            host = read_host_memory()
            growth = sum(max(0, h.estimate - h.resident) for h in holding)
            free = host.available - host.reserve - growth
            what = (f"the CPU default: {gib(host.available)} available - {gib(host.reserve)} reserve - {gib(growth)} "
                    f"the loaded models may still grow into")
        if need.total > free:
            loaded = ", ".join(f"{h.name} {gib(h.accounted)}" for h in holding) or "none"
            raise MemoryBudgetExceededError(
                f"model {name!r} needs {need.describe()} but only {gib(max(0, free))} is free "
                f"({what}; loaded: {loaded})")

    def share_bytes(self, share: float, on_gpu: bool) -> int | None:
        """Bytes a model given memory_share `share` may hold in all (None: no budget to take a share of)."""
        if self.budget is not None:
            return int(self.budget * share)
        total = gpu_total_bytes() if on_gpu else read_host_memory().total
        return None if total is None else int(total * share * (self.gpu_memory_utilization if on_gpu else 1.0))


def gpu_total_bytes() -> int | None:
    """The first GPU's memory, from nvidia-smi (None without one)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def tree_resident_bytes(pid: int) -> int:
    """What an engine core holds with its tensor/pipeline-parallel workers (its child processes): their RSS summed
    (a worker Ray placed is a Ray actor's child, not the core's: not counted here)."""
    return sum(map(resident_bytes, process_tree(pid)))


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """`pid` and its descendants, found by each process's parent in /proc/<pid>/stat (/proc/<pid>/task/*/children
    needs a kernel option some hosts lack)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:  # "<pid> (<comm, which may hold spaces and parentheses>) <state> <ppid> ..."
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):  # it exited meanwhile
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def resident_bytes(pid: int) -> int:
    """A process's resident memory (0 once it has exited, or where /proc is absent)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def runs_on_gpu(engine: EngineConfig) -> bool:
    """Whether this model's core will run on a GPU (device auto: an NVIDIA driver is present)."""
    device = engine.model.device
    return device.startswith("cuda") or (device == "auto" and os.path.exists("/dev/nvidiactl"))
