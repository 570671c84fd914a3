"""POST /v1/embeddings: OpenAI's embeddings API over prefill-only engine requests.

    body --EmbeddingRequest--> inputs (text, texts, token ids, lists of token ids) --tokenize (off the loop)-->
    one engine request per input, PoolingParams(dimensions) --> each one delta with its embedding --> the list

Each input is an ordinary request to the core (admission, rate limits, the tenant's cache namespace), never
sampled: it ends the step its prompt is computed and its pages are freed at once. A client that leaves aborts
them. `dimensions` on a model without Matryoshka support, or beyond its hidden size, is a 400 from the engine
(param "dimensions"); base64 is the little-endian float32 bytes, as OpenAI's client decodes them.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import struct
import time
from contextlib import aclosing
from typing import Any, Literal

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from banyan.ipc.client import RequestError
from banyan.ipc.messages import AddRequest
from banyan.pooling_params import PoolingParams
from banyan.request import RequestDelta
from banyan.sampling_params import SamplingParams
from banyan.server import protocol
from banyan.server.audit import record_usage
from banyan.server.auth import ApiKeyAuth, Tenant
from banyan.server.errors import APIError, from_banyan_error
from banyan.server.protocol_parts import RequestModel
from banyan.server.serving import OpenAIServing, until_disconnect

_serials = itertools.count()


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: protocol.PromptsInput
    """A text, a list of texts, a list of token ids, or a list of such lists; one embedding each."""
    dimensions: int | None = Field(None, ge=1, le=2**31 - 1)
    """Keep the first `dimensions` values (Matryoshka models only: the model's config.json says is_matryoshka)."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each embedding as the base64 of its little-endian float32 bytes."""
    user: str | None = None

    @field_validator("input", mode="plain", json_schema_input_type=protocol.PromptsInput)
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return protocol.check_prompts(value)


async def create_embeddings(serving: OpenAIServing, body: dict, tenant: Tenant, http: Request) -> Response:
    """The endpoint, on the model's OpenAIServing (its model check, text pool, admission and engine client)."""
    req = protocol.parse(EmbeddingRequest, body)
    serving.check_model(req.model)
    prompts = await serving.offload(serving.tokenize_prompts, req.input)
    for ids in prompts:
        _check_length(serving, ids)
    serving.admit(tenant, sum(map(len, prompts)), len(prompts))
    pooling = PoolingParams(dimensions=req.dimensions)
    key = f"embd-{http.state.request_id}.{next(_serials)}"
    namespace = ApiKeyAuth.namespace_for(tenant, None)
    lora = serving.lora.get(req.model) if serving.lora is not None else None  # a LoRA adapter's name: its states
    adds = [AddRequest(f"{key}-{i}", ids, SamplingParams(max_tokens=1), arrival_time=time.time(), cache_salt=namespace,
                       pooling_params=pooling, lora_request=lora) for i, ids in enumerate(prompts)]
    deltas = await until_disconnect(_embed_all(serving.client, adds), http)
    if deltas is None:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": _encode(d.embedding, req.encoding_format)}
            for i, d in enumerate(deltas)]
    model, num_tokens = serving.answering(req.model), sum(map(len, prompts))
    record_usage(http.scope.setdefault("state", {}), model=model, prompt_tokens=num_tokens, completion_tokens=0,
                 cached_tokens=sum(d.num_cached_tokens for d in deltas), finish_reasons=["stop"] * len(deltas))
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _check_length(serving: OpenAIServing, ids: list[int]) -> None:
    limit = serving.max_model_len
    if len(ids) > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but the input has {len(ids)}",
                       param="input", code="context_length_exceeded")
    serving.check_token_ids(ids, "input")


async def _embed_all(client, adds: list[AddRequest]) -> list[RequestDelta]:
    """Every input's last delta (its embedding); the first failure cancels (aborts) the others and is raised as an
    APIError."""
    tasks = [asyncio.ensure_future(_embed(client, add)) for add in adds]
    try:
        return await asyncio.gather(*tasks)
    except RequestError as e:
        raise from_banyan_error(e) from None
    finally:
        for task in tasks:
            task.cancel()


async def _embed(client, add: AddRequest) -> RequestDelta:
    async with aclosing(client.generate(add)) as deltas:  # leaving early aborts it in the core
        async for delta in deltas:
            if delta.embedding is not None:
                return delta
    raise APIError(500, "the engine ended an embedding request without its embedding", type="server_error")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
