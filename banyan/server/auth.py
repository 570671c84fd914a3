"""API keys, tenants and per-tenant rate limits.

A caller presents `Authorization: Bearer <key>`. ApiKeyAuth maps it to a Tenant: a short id that is
safe to log (never the key) and the prefix-cache namespace its requests run in. The namespace is
derived on the server from the key, so one tenant can never hit (or time) another tenant's cached
prefix; a client's `cache_salt` only splits its own tenant's namespace further.

    key --sha256------------------> tenant_id        "t-3fa9c0e1b27d"    (stable, for logs/metrics)
    key --hmac(process secret)----> cache_namespace  "t:<64 hex>"        (unguessable, per process)
    namespace + sha256(salt) -----> "t:<64 hex>/s:<64 hex>"              (client sub-namespace)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from banyan.errors import BanyanError, InvalidParameterError

logger = logging.getLogger(__name__)

API_KEY_ENV = "BANYAN_API_KEY"
ADMIN_API_KEY_ENV = "BANYAN_ADMIN_API_KEY"


class ApiKeyConfigError(BanyanError, ValueError):
    """A configured API key (flag, environment or key file) is empty, malformed or unreadable."""


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    """A short non-reversible id of the caller's key; safe in logs and metric labels."""
    cache_namespace: str | None
    """The prefix-cache namespace of this tenant's requests; None is the shared namespace."""


ANONYMOUS = Tenant(tenant_id="anonymous", cache_namespace=None)


# ---------------------------------------------------------------------------------------- keys


def load_api_keys(
    cli_keys: Sequence[str], env: Mapping[str, str], key_file: str | None,
    *, flag: str = "--api-key", env_name: str = API_KEY_ENV,
) -> list[str]:
    """Every configured key, in order, without duplicates.

    Sources: each `--api-key`, the `BANYAN_API_KEY` variable (comma-separated) and a key file (one
    key per line; blank lines and lines starting with `#` skipped). An empty or malformed key in
    any source raises ApiKeyConfigError rather than silently leaving the server open. The admin
    keys load the same way from `--admin-api-key` and `BANYAN_ADMIN_API_KEY`.
    """
    keys = [_checked(k, flag) for k in cli_keys]
    if env_name in env:
        keys += [_checked(k, env_name) for k in env[env_name].split(",")]
    if key_file is not None:
        keys += _read_key_file(key_file)
    return list(dict.fromkeys(keys))


def _read_key_file(path: str) -> list[str]:
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyConfigError(f"cannot read API key file {path!r}: {e}") from e
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("API key file %r is readable by other users; chmod 600 it", path)
    keys = [
        _checked(line, f"{path}:{i}")
        for i, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise ApiKeyConfigError(f"API key file {path!r} holds no keys")
    return keys


def _checked(key: str, source: str) -> str:
    """The key without surrounding whitespace; a key that cannot travel in a header is refused."""
    key = key.strip()
    if not key:
        raise ApiKeyConfigError(f"empty API key in {source}")
    if not key.isprintable() or any(c.isspace() for c in key):
        raise ApiKeyConfigError(f"API key in {source} contains whitespace or control characters")
    return key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# ---------------------------------------------------------------------------------------- auth


class ApiKeyAuth:
    """Checks bearer keys in constant time and maps each key to its Tenant.

    With no keys configured, auth is off and every caller is the anonymous tenant (shared cache).
    With `share_prefix_cache`, tenants keep their own ids but share one cache namespace (None).
    """

    def __init__(self, keys: Sequence[str], *, share_prefix_cache: bool = False):
        keys = list(dict.fromkeys(_checked(k, "ApiKeyAuth") for k in keys))
        secret = secrets.token_bytes(32)  # per process: namespaces cannot be predicted offline
        self._digests = [_digest(k) for k in keys]
        self._tenants = [
            Tenant(
                tenant_id="t-" + hashlib.sha256(b"banyan-tenant:" + d).hexdigest()[:12],
                cache_namespace=None
                if share_prefix_cache
                else "t:" + hmac.new(secret, d, hashlib.sha256).hexdigest(),
            )
            for d in self._digests
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def authenticate(self, authorization_header: str | None) -> Tenant | None:
        """The caller's Tenant, or None when auth is on and the header holds no valid key.

        Every configured key is compared, always all of them, on fixed-length SHA-256 digests, so
        the time taken reveals neither the key's length, nor how much of it matched, nor which
        configured key (if any) it was.
        """
        if not self.enabled:
            return ANONYMOUS
        token = _bearer_token(authorization_header)
        presented = _digest(token or "")  # still compared when malformed: same time either way
        found = None
        for digest, tenant in zip(self._digests, self._tenants):
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found if token else None

    @staticmethod
    def namespace_for(tenant: Tenant, client_cache_salt: str | None) -> str | None:
        """The cache namespace of one request: the tenant's, split further by the client's salt.

        The salt is hashed, so whatever the client sends (separators, another tenant's namespace)
        it only ever names a sub-namespace of its own tenant, and anonymous salts (`s:...`) never
        equal a tenant's namespace (`t:...`).
        """
        if client_cache_salt is None:
            return tenant.cache_namespace
        salt = "s:" + hashlib.sha256(client_cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
        if tenant.cache_namespace is None:
            return salt
        return f"{tenant.cache_namespace}/{salt}"


def _bearer_token(header: str | None) -> str | None:
    """`<key>` from `Bearer <key>` (scheme case-insensitive), or None when malformed."""
    if header is None:
        return None
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


class AdminAuth:
    """The admin routes' keys: kept apart from the user keys, so a user key can never administer.

    `check` answers 200 (an admin key), 403 (a valid user key: known but not allowed) or 401.
    With no admin key configured the admin routes do not exist (the caller answers 404).
    """

    def __init__(self, admin_keys: Sequence[str], users: ApiKeyAuth):
        keys = list(dict.fromkeys(_checked(k, "--admin-api-key") for k in admin_keys))
        self._digests = [_digest(k) for k in keys]
        self._users = users

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization_header: str | None) -> int:
        token = _bearer_token(authorization_header)
        presented = _digest(token or "")
        found = False
        for digest in self._digests:  # all compared, in constant time, as for user keys
            found |= hmac.compare_digest(digest, presented)
        if token and found:
            return 200
        if token and self._users.enabled and self._users.authenticate(authorization_header) is not None:
            return 403
        return 401


# ---------------------------------------------------------------------------------- rate limits


@dataclass(slots=True)
class _Bucket:
    requests: float  # requests left; refills at rpm/60 per second up to rpm
    tokens: float  # tokens left; refills at tpm/60 per second up to tpm (negative: in debt)
    last: float  # clock time of the last refill
    full_at: float  # clock time at which both buckets are full again (then it can be dropped)


class RateLimiter:
    """Per-tenant token buckets for requests per minute and tokens per minute.

    A limit of None is no limit. Buckets start full, so a tenant can burst a minute's budget. A
    request larger than the whole token budget is admitted when the bucket is full and leaves it
    in debt, rather than never being admitted. Memory is bounded: a tenant whose buckets have
    refilled is indistinguishable from a new one and is dropped; past `max_tenants` the least
    recently seen tenant is dropped too.
    """

    def __init__(
        self,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_tenants: int = 100_000,
    ):
        for name, limit in [("requests_per_minute", requests_per_minute),
                            ("tokens_per_minute", tokens_per_minute)]:
            if limit is not None and limit <= 0:
                raise InvalidParameterError(name, f"must be positive, got {limit}")
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self._clock = clock
        self._max_tenants = max_tenants
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently seen first

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, tenant_id: str, num_tokens: int) -> float | None:
        """None if admitted (and charged); else seconds until it would be (nothing charged)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if not self.enabled:
            return None
        now = self._clock()
        self._prune(now)
        bucket = self._refilled(tenant_id, now)
        wait = max(
            self._wait(bucket.requests, 1, self.rpm),
            self._wait(bucket.tokens, num_tokens, self.tpm),
        )
        if wait > 0:
            return wait
        if self.rpm is not None:
            bucket.requests -= 1
        if self.tpm is not None:
            bucket.tokens -= num_tokens
        bucket.full_at = now + max(
            self._wait(bucket.requests, self.rpm or 0, self.rpm),
            self._wait(bucket.tokens, self.tpm or 0, self.tpm),
        )
        return None

    @staticmethod
    def _wait(level: float, need: float, limit: int | None) -> float:
        """Seconds until `level` reaches `need` (capped at the bucket size `limit`)."""
        if limit is None:
            return 0.0
        return max(0.0, (min(need, limit) - level) * 60.0 / limit)

    def _refilled(self, tenant_id: str, now: float) -> _Bucket:
        bucket = self._buckets.pop(tenant_id, None)
        if bucket is None:
            bucket = _Bucket(float(self.rpm or 0), float(self.tpm or 0), now, now)
        elapsed = max(0.0, now - bucket.last)
        if self.rpm is not None:
            bucket.requests = min(float(self.rpm), bucket.requests + elapsed * self.rpm / 60.0)
        if self.tpm is not None:
            bucket.tokens = min(float(self.tpm), bucket.tokens + elapsed * self.tpm / 60.0)
        bucket.last = now
        self._buckets[tenant_id] = bucket  # most recently seen last
        while len(self._buckets) > self._max_tenants:
            self._buckets.popitem(last=False)
        return bucket

    def _prune(self, now: float) -> None:
        buckets = self._buckets
        while buckets and next(iter(buckets.values())).full_at <= now:
            buckets.popitem(last=False)
