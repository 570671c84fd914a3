"""ResidentAdapters: which LoRA adapters hold the model's max_loras weight slots, and their loading.

    add_request ──► track(): check the adapter (config + header), start reading its tensors on the loader
                    thread unless resident or on its way
    schedule    ──► admit(): a running request pins its adapter's slot; an adapter whose tensors are read
                    takes a free slot, or the least recently used one no running request pins (LRU), and is
                    handed to the runner in the step's Batch (lora_loads) to be copied in before the forward;
                    one that finds every slot pinned is starved: no request pins a slot anew until it has one,
                    so the running ones drain a slot for it (else steady traffic on resident adapters would
                    keep it waiting for ever)
    preempt     ──► unpin();  finish ──► forget(): an adapter no request needs is dropped if still loading

So the step loop never reads a file: it only copies tensors the loader thread has made ready. At most
num_slots adapters are resident; a waiting request whose adapter finds no slot waits (others go ahead).
The scheduler and engine see this class only; the tensors it passes along are opaque to it (no torch here).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from banyan.config import ModelArch
from banyan.errors import LoRAAdapterError
from banyan.lora.adapter import AdapterSpec, read_adapter
from banyan.lora.request import LoRARequest
from banyan.request import Request


class ResidentAdapters:
    def __init__(self, num_slots: int, max_rank: int, arch: ModelArch, load: Callable[[AdapterSpec], Any]):
        """load(spec) -> the adapter's tensors for the runner; runs on the loader thread."""
        self.num_slots, self.max_rank, self.arch = num_slots, max_rank, arch
        self._load = load
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="banyan-lora")
        self.specs: dict[int, AdapterSpec] = {}  # adapter id -> spec, while resident or loading
        self.paths: dict[int, str] = {}
        self.slot_of: dict[int, int] = {}  # resident adapter id -> slot
        self.idle: OrderedDict[int, None] = OrderedDict()  # resident adapters no running request pins, LRU first
        self.loading: dict[int, Future] = {}
        self.pinned: dict[str, int] = {}  # running request id -> its adapter id
        self.users: dict[int, int] = {}  # resident adapter id -> running requests pinning it
        self.needed: dict[int, int] = {}  # adapter id -> unfinished requests using it
        self.pending_loads: list[tuple[int, Any]] = []  # (slot, tensors) for the next step's Batch
        self.starved: dict[int, None] = {}  # adapters ready to run that found every slot pinned, first first
        self.num_loads = 0  # adapters copied into a slot since start-up (evictions + first loads)

    # -- requests ------------------------------------------------------------------------------
    def track(self, request: Request, lora: LoRARequest) -> None:
        """Check the adapter (LoRAAdapterError naming the problem), tag the request with it, start its load."""
        if not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
            raise LoRAAdapterError(f"lora_int_id must be a positive integer, got {lora.lora_int_id!r}")
        adapter_id = lora.lora_int_id
        known = self.paths.get(adapter_id)
        if known is not None and known != lora.lora_path:
            raise LoRAAdapterError(f"LoRA id {adapter_id} is already loaded from {known}, not {lora.lora_path}")
        spec = self.specs.get(adapter_id) or read_adapter(lora.lora_path, self.arch, self.max_rank)
        if adapter_id not in self.slot_of and adapter_id not in self.loading:
            self.specs[adapter_id], self.paths[adapter_id] = spec, lora.lora_path
            self.loading[adapter_id] = self._loader.submit(self._load, spec)
        request.lora_id, request.lora_namespace = adapter_id, spec.fingerprint
        self.needed[adapter_id] = self.needed.get(adapter_id, 0) + 1

    def admit(self, request: Request) -> bool:
        """Pin the request's adapter in a slot so it can run this step; False when it must wait (still loading,
        or every slot pinned). A load that failed fails the request (request.is_finished)."""
        adapter_id = request.lora_id
        if self.starved and adapter_id not in self.starved:
            return False  # let pinned slots drain for the adapter that waits for one
        if adapter_id in self.slot_of:
            self.idle.pop(adapter_id, None)
        elif not self._swap_in(request):
            return False
        self.pinned[request.request_id] = adapter_id
        self.users[adapter_id] = self.users.get(adapter_id, 0) + 1
        return True

    def unpin(self, request: Request) -> None:
        """The request stopped running (preempted or finished): its adapter may be evicted once no one pins it."""
        adapter_id = self.pinned.pop(request.request_id, None)
        if adapter_id is None:
            return
        self.users[adapter_id] -= 1
        if self.users[adapter_id] == 0:
            del self.users[adapter_id]
            self.idle[adapter_id] = None

    def forget(self, request: Request) -> None:
        """The request ended: unpin it; an adapter no unfinished request needs stops loading."""
        self.unpin(request)
        left = self.needed.get(request.lora_id, 1) - 1
        if left > 0:
            self.needed[request.lora_id] = left
            return
        self.needed.pop(request.lora_id, None)
        self.starved.pop(request.lora_id, None)
        future = self.loading.pop(request.lora_id, None)
        if future is not None:
            future.cancel()
        if request.lora_id not in self.slot_of:  # evicted (or never in): nothing left of it
            self._drop(request.lora_id)

    def take_loads(self) -> list[tuple[int, Any]]:
        """The (slot, tensors) swapped in since the last step, for the runner to copy before its forward."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def wait(self, timeout: float) -> None:
        """Block until an adapter being read is ready (or the timeout): the step has nothing else to run."""
        if self.loading:
            wait(list(self.loading.values()), timeout, FIRST_COMPLETED)

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- slots ---------------------------------------------------------------------------------
    def _swap_in(self, request: Request) -> bool:
        adapter_id = request.lora_id
        future = self.loading.get(adapter_id)
        if future is None:  # evicted since the request was added (it was preempted): read it again
            future = self.loading[adapter_id] = self._loader.submit(self._load, self.specs[adapter_id])
        if not future.done():
            return False
        error = future.exception()
        if error is not None:
            self.loading.pop(adapter_id)
            message = error.args[0] if isinstance(error, LoRAAdapterError) else f"loading the LoRA adapter failed: {error}"
            request.fail(message, "lora_request")
            return False
        slot = self._free_slot()
        if slot is None:
            self.starved[adapter_id] = None
            return False
        self.starved.pop(adapter_id, None)
        self.loading.pop(adapter_id)
        self.slot_of[adapter_id] = slot
        self.pending_loads.append((slot, future.result()))
        self.num_loads += 1
        return True

    def _free_slot(self) -> int | None:
        """A slot no adapter holds, else the least recently used idle adapter's (evicted), else None."""
        taken = set(self.slot_of.values())
        free = next((s for s in range(self.num_slots) if s not in taken), None)
        if free is not None or not self.idle:
            return free
        victim, _ = self.idle.popitem(last=False)
        slot = self.slot_of.pop(victim)
        if victim not in self.needed:
            self._drop(victim)
        return slot

    def _drop(self, adapter_id: int) -> None:
        """No longer resident nor loading: its id may be reused for another path."""
        self.specs.pop(adapter_id, None)
        self.paths.pop(adapter_id, None)
