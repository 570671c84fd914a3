"""One served model: its spec, state, engine core (EngineClient), serving, metrics and memory, as the registry
(models.py) holds it and GET /admin/models and /v1/models show it."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from banyan.ipc.client import EngineClient
from banyan.ipc.dp_client import DataParallelClient
from banyan.server.metrics import ServerMetrics
from banyan.server.model_memory import Holding, MemoryEstimate, tree_resident_bytes
from banyan.server.model_specs import ModelSpec
from banyan.server.serving import OpenAIServing


class ModelState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass(eq=False)
class ModelEntry:
    spec: ModelSpec
    estimate: MemoryEstimate
    state: ModelState = ModelState.LOADING
    error: str | None = None
    client: EngineClient | None = None
    serving: OpenAIServing | None = None
    metrics: ServerMetrics | None = None
    active: int = 0  # requests resolved to this entry whose handler has not returned yet
    replacement: ModelEntry | None = None  # a swap loading under the same name
    started_with_server: bool = False  # given at start-up (or swapped in for one): its core's death ends the server
    loaded_at: float | None = None
    tokenizer: object = None  # the server's own copy (templates, tokenizing): opened before the core starts
    adapters: dict[str, dict] = field(default_factory=dict)
    """LoRA adapters served on top of this model: name -> extra fields of its /v1/models card (e.g. its path);
    requests naming one are dispatched to this entry, with `model` unchanged."""
    tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def resident(self) -> int:
        """What its cores on this host hold now with their tensor/pipeline-parallel workers (RSS, summed over
        data-parallel replicas; 0 before they started and after they exited)."""
        return sum(map(tree_resident_bytes, self.client.local_pids)) if self.client is not None else 0

    def holding(self) -> Holding:
        return Holding(self.name, self.estimate.total, self.resident)

    def busy(self) -> bool:
        return self.active > 0 or (self.serving is not None and bool(self.serving.in_flight()))

    def describe(self) -> dict:
        """GET /admin/models' entry."""
        out = {"name": self.name, "model": self.spec.source, "state": self.state.value,
               "memory_bytes": self.resident or self.estimate.total, "memory_estimate_bytes": self.estimate.total,
               "aliases": list(self.spec.names[1:])}
        if self.loaded_at is not None:
            out["ready_at"] = self.loaded_at  # unix time it became ready (a swap: when the name switched to it)
        if self.client is not None and self.client.info is not None:
            out |= {"pid": self.client.pid, "max_model_len": self.client.info.max_model_len,
                    "kv_cache_tokens": self.client.info.num_pages * self.client.info.page_size}
        if isinstance(self.client, DataParallelClient):
            out["replicas"] = replica_entries(self.client)
        if self.error is not None:
            out["error"] = self.error
        if self.replacement is not None:
            out["swap"] = {"model": self.replacement.spec.source, "state": self.replacement.state.value,
                           **({"error": self.replacement.error} if self.replacement.error else {})}
        return out

    def cards(self, created: int) -> list[dict]:
        """Its /v1/models cards: one per name, then one per adapter with `parent` (as vLLM lists them)."""
        max_len = self.client.info.max_model_len if self.client is not None and self.client.info else None
        base = {"object": "model", "created": created, "owned_by": "banyan", "max_model_len": max_len}
        return ([{"id": name, "root": self.spec.source, "parent": None, **base} for name in self.spec.names]
                + [{"id": name, "root": name, "parent": self.name, **base, **extra}
                   for name, extra in self.adapters.items()])


def replica_entries(client: DataParallelClient) -> list[dict]:
    """Each data-parallel replica in GET /admin/models' entry: state, restarts, its core's pid, memory and KV cache
    (memory_bytes: its core's and workers' RSS; None for a core on another host; 0 while it is down)."""
    entries = []
    for index, (replica, health) in enumerate(zip(client.replicas, client.health)):
        info, pids = replica.info, replica.local_pids
        entries.append({"replica": index, "state": health.state, "pid": replica.pid,
                        "memory_bytes": sum(map(tree_resident_bytes, pids)) if pids or health.state != "up" else None,
                        "kv_cache_tokens": info.num_pages * info.page_size if info is not None else None,
                        "restarts": health.restarts, "failed_starts": health.failed_starts,
                        "last_error": health.last_error})
    return entries
