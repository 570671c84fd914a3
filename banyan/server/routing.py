"""A/B and canary routes: a route name that splits requests over models by weight, sticky per user.

    --route chat=modelA:90,modelB:10          PUT /admin/routes/chat {"variants": {"modelA": 90, "modelB": 10}}

A request for `chat` goes to one variant. The choice hashes (route, user) to a point u in [0, 1) and
takes the variant whose slice of the cumulative weights holds it:

    0 ─────────────── modelA ─────────────── 0.9 ── modelB ── 1
                           u = hash(route, user) / 2^64

so one user always lands on the same variant while the weights stay, and a change of weights moves only
the users whose point changes slice. The user is the request's OpenAI `user` field, else its API key's
tenant; a request with neither (no keys configured, no `user`) is placed at random. The response's `model`
names the variant that answered; RouteMetrics counts per route and variant.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from banyan.errors import InvalidParameterError
from banyan.server.metrics import ITL_BUCKETS, TTFT_BUCKETS

ROUTE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-")


@dataclass(frozen=True)
class Route:
    name: str
    variants: tuple[tuple[str, float], ...]  # (model name, weight > 0), in the order given

    def choose(self, user: str | None, available: Iterable[str] | None = None) -> str:
        """The variant for `user` (None: at random); available: the variants that can serve now (None: all)."""
        candidates = [(m, w) for m, w in self.variants if available is None or m in available]
        if not candidates:
            raise LookupError(self.name)
        bounds = list(itertools.accumulate(w for _, w in candidates))
        point = sticky_point(self.name, user) if user is not None else random.random()
        return candidates[min(bisect.bisect_right(bounds, point * bounds[-1]), len(candidates) - 1)][0]

    def as_dict(self) -> dict:
        return {"name": self.name, "variants": {m: w for m, w in self.variants}}


def sticky_point(route: str, user: str) -> float:
    """A user's fixed point in [0, 1) for this route (BLAKE2b: the same in every process and run)."""
    digest = hashlib.blake2b(f"{route}\0{user}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def parse_route(text: str) -> Route:
    """'chat=modelA:90,modelB:10' -> Route (InvalidParameterError naming what is wrong)."""
    name, sep, rest = text.partition("=")
    if not sep:
        raise InvalidParameterError("route", f"expected NAME=MODEL:WEIGHT,MODEL:WEIGHT, got {text!r}")
    variants = {}
    for part in rest.split(","):
        model, sep, weight = part.strip().rpartition(":")
        try:
            variants[model] = float(weight) if sep else None
        except ValueError:
            variants[model] = weight
    return make_route(name.strip(), variants)


def make_route(name: object, variants: object) -> Route:
    """A route from a name and {model: weight} (the admin API's body, a YAML file's entry)."""
    if not isinstance(name, str) or not name or len(name) > 128 or not set(name) <= ROUTE_NAME_CHARS:
        raise InvalidParameterError("route", "a route name is 1-128 letters, digits or ._:/-")
    if not isinstance(variants, dict) or not variants:
        raise InvalidParameterError("variants", "must map each model to its weight, e.g. {\"a\": 90, \"b\": 10}")
    pairs = []
    for model, weight in variants.items():
        if not isinstance(model, str) or not model:
            raise InvalidParameterError("variants", "a variant is a model name")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise InvalidParameterError(f"variants.{model}", f"the weight must be a number >= 0, got {weight!r}")
        pairs.append((model, float(weight)))
    if not any(w > 0 for _, w in pairs):
        raise InvalidParameterError("variants", "at least one weight must be above 0")
    return Route(name, tuple((m, w) for m, w in pairs if w > 0))


class RouteMetrics:
    """Per route and variant: requests, tokens, errors, TTFT and ITL (banyan:route_*), in its own registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        labels = ["route", "variant"]
        self.requests = Counter("banyan:route_requests", "Requests a route sent to a variant.", labels,
                                registry=self.registry)
        self.errors = Counter("banyan:route_errors", "Requests of a route's variant that failed.", labels,
                              registry=self.registry)
        self.prompt_tokens = Counter("banyan:route_prompt_tokens", "Prompt tokens per route and variant.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("banyan:route_generation_tokens", "Generated tokens per route and variant.",
                                         labels, registry=self.registry)
        self.ttft = Histogram("banyan:route_time_to_first_token_seconds", "Time to first token per route and variant.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("banyan:route_inter_token_latency_seconds", "Time between output tokens per route and "
                             "variant.", labels, buckets=ITL_BUCKETS, registry=self.registry)

    def observe(self, route: str, variant: str, *, ok: bool, prompt_tokens: int = 0, generation_tokens: int = 0,
                ttft: float | None = None, itls: Iterable[float] = ()) -> None:
        self.requests.labels(route, variant).inc()
        if not ok:
            self.errors.labels(route, variant).inc()
        self.prompt_tokens.labels(route, variant).inc(prompt_tokens)
        self.generation_tokens.labels(route, variant).inc(generation_tokens)
        if ttft is not None:
            self.ttft.labels(route, variant).observe(ttft)
        for itl in itls:
            self.itl.labels(route, variant).observe(itl)
