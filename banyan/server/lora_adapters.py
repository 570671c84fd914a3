"""The LoRA adapters a served model answers to by name (vLLM's interface), and their two admin routes.

    banyan serve --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat
    POST /v1/completions {"model": "sql", ...}         -> the request runs with adapter "sql" (404 if unknown)
    POST /v1/load_lora_adapter {"lora_name", "lora_path"}   admin key: checked now (400 naming the problem)
    POST /v1/unload_lora_adapter {"lora_name"}             admin key: new requests get 404; running ones finish

Each name gets its own lora_int_id, never reused, so a name loaded again from another path is another adapter to
the engine (and another prefix-cache namespace). Files are checked here, without torch, against the model's
shape; the engine core reads the tensors when the first request needs them.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from banyan.checkpoint import open_checkpoint
from banyan.config import ModelArch
from banyan.errors import BanyanError
from banyan.lora.adapter import read_adapter
from banyan.lora.request import LoRARequest
from banyan.server import openapi
from banyan.server.errors import APIError, from_banyan_error

NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


class LoRAAdapters:
    def __init__(self, arch: ModelArch, max_rank: int, base_names: tuple[str, ...], cards: dict[str, dict]):
        """cards: the model entry's adapter cards (name -> extra /v1/models fields), kept in step with the adapters."""
        self.arch, self.max_rank, self.base_names = arch, max_rank, base_names
        self.requests: dict[str, LoRARequest] = {}
        self.cards = cards
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model's names (check_model answers the rest)."""
        return self.requests.get(name) if name is not None else None

    def load(self, name: object, path: object) -> LoRARequest:
        """Check and add an adapter (APIError 400 naming the problem: a bad name, a name in use, a bad adapter)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise APIError(400, "lora_name must be 1-128 letters, digits or ._:/-", param="lora_name")
        if not isinstance(path, str) or not path:
            raise APIError(400, "lora_path must be the adapter's directory", param="lora_path")
        if name in self.requests or name in self.base_names:
            raise APIError(400, f"the name {name!r} is already served; unload it first", param="lora_name",
                           code="lora_name_in_use")
        try:
            read_adapter(path, self.arch, self.max_rank)
        except BanyanError as e:
            raise from_banyan_error(e) from None
        request = self.requests[name] = LoRARequest(name, next(self._ids), path)
        self.cards[name] = {"root": path}
        return request

    def unload(self, name: object) -> None:
        if not isinstance(name, str) or name not in self.requests:
            raise APIError(404, f"no LoRA adapter named {str(name)[:128]!r} is loaded", type="NotFoundError",
                           param="lora_name", code="lora_not_found")
        del self.requests[name]
        self.cards.pop(name, None)


def parse_lora_modules(values: tuple[str, ...]) -> list[tuple[str, str]]:
    """--lora-modules name=path ... -> [(name, path)]; BanyanError-free: a malformed one is an APIError (400)."""
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise APIError(400, f"--lora-modules takes name=path, got {value!r}", param="lora_modules")
        pairs.append((name, path))
    return pairs


def install(app: FastAPI, adapters_of: Callable[[], LoRAAdapters | None], read_body) -> None:
    """The two admin routes (the guard requires the admin key on both: app.ADMIN_PATHS)."""

    def adapters() -> LoRAAdapters:
        found = adapters_of()
        if found is None:
            raise APIError(400, "LoRA is not enabled on this server (--enable-lora)", code="lora_disabled")
        return found

    @app.post("/v1/load_lora_adapter", **_docs(
        "Admin key only. Load a PEFT adapter directory under a name requests then select as `model` (vLLM's route).",
        {"lora_name": {"type": "string"}, "lora_path": {"type": "string"}}))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_body(request)
        name = body.get("lora_name")
        await asyncio.to_thread(adapters().load, name, body.get("lora_path"))  # reads files: off the event loop
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", **_docs(
        "Admin key only. New requests for the adapter get 404; running ones finish (vLLM's route).",
        {"lora_name": {"type": "string"}}))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_body(request)
        adapters().unload(body.get("lora_name"))
        return PlainTextResponse(f"Success: LoRA adapter '{body.get('lora_name')}' removed successfully.")



def _docs(description: str, fields: dict) -> dict:
    """The route's OpenAPI entry: a JSON body of these string fields, a text answer, the admin routes' errors."""
    docs = openapi.route_docs(None, errors=(400, 401, 403, 404, 503), description=description)
    docs["responses"][200] = {"description": "success", "content": {"text/plain": {"schema": {"type": "string"}}}}
    body = {"type": "object", "properties": fields, "required": list(fields)}
    return docs | {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}}


def for_model(entry, lora_modules: tuple[str, ...]) -> LoRAAdapters:
    """The adapters of a model entry served with --enable-lora (its shape read from its checkpoint, torch-free),
    with the --lora-modules of the command line added (the start fails on a bad one, naming it)."""
    model = entry.spec.engine.model
    arch = open_checkpoint(model.model, model.trust_remote_code, model.tokenizer).arch
    adapters = LoRAAdapters(arch, entry.spec.engine.lora.max_lora_rank, entry.spec.names, entry.adapters)
    for name, path in parse_lora_modules(lora_modules):
        adapters.load(name, path)
    return adapters
