"""API keys, tenants, cache namespaces and rate limits (banyan.server.auth)."""

import hmac
import logging
import os

import pytest

from banyan.server import auth
from banyan.server.auth import ApiKeyAuth, ApiKeyConfigError, RateLimiter, Tenant, load_api_keys

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-9876543210"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------- load keys


def test_keys_come_from_flags_env_and_file_in_order_without_duplicates(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\n\n  file-key-1  \nfile-key-2\n#file-key-3\nflag-key\n")
    os.chmod(key_file, 0o600)
    keys = load_api_keys(
        ["flag-key"], {"BANYAN_API_KEY": "env-key-1, env-key-2"}, str(key_file)
    )
    assert keys == ["flag-key", "env-key-1", "env-key-2", "file-key-1", "file-key-2"]


def test_no_source_means_no_keys():
    assert load_api_keys([], {}, None) == []


@pytest.mark.parametrize(
    "cli, env",
    [([""], {}), (["  "], {}), ([], {"BANYAN_API_KEY": ""}), ([], {"BANYAN_API_KEY": "a,,b"}),
     (["two words"], {}), (["tab\tkey"], {}), (["nul\x00key"], {})],
)
def test_empty_or_malformed_keys_are_refused(cli, env):
    with pytest.raises(ApiKeyConfigError):
        load_api_keys(cli, env, None)


def test_key_file_errors(tmp_path):
    with pytest.raises(ApiKeyConfigError):
        load_api_keys([], {}, str(tmp_path / "missing"))
    only_comments = tmp_path / "empty"
    only_comments.write_text("# nothing here\n\n")
    with pytest.raises(ApiKeyConfigError):
        load_api_keys([], {}, str(only_comments))


def test_world_readable_key_file_only_warns(tmp_path, caplog):
    key_file = tmp_path / "keys"
    key_file.write_text("k1\n")
    os.chmod(key_file, 0o644)
    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        assert load_api_keys([], {}, str(key_file)) == ["k1"]
    assert "readable" in caplog.text
    assert "k1" not in caplog.text


# ------------------------------------------------------------------------------- authenticate


def test_no_keys_means_everyone_is_the_anonymous_tenant():
    a = ApiKeyAuth([])
    assert not a.enabled
    for header in [None, "", "Bearer whatever", "Basic xyz"]:
        tenant = a.authenticate(header)
        assert tenant == Tenant(tenant_id="anonymous", cache_namespace=None)


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", f"Basic {KEY_A}", f"Token {KEY_A}", KEY_A, "Bearer wrong",
     f"Bearer {KEY_A}x", f"Bearer {KEY_A[:-1]}", f"Bearer {KEY_A} extra", f"Bearer{KEY_A}"],
)
def test_missing_malformed_or_wrong_keys_are_refused(header):
    assert ApiKeyAuth([KEY_A, KEY_B]).authenticate(header) is None


@pytest.mark.parametrize(
    "header", [f"Bearer {KEY_A}", f"bearer {KEY_A}", f"BEARER {KEY_A}", f"  Bearer   {KEY_A}  "]
)
def test_right_key_with_any_scheme_case_and_whitespace_is_accepted(header):
    a = ApiKeyAuth([KEY_A, KEY_B])
    assert a.enabled
    assert a.authenticate(header) == a.authenticate(f"Bearer {KEY_A}") is not None


def test_tenants_differ_per_key_and_never_reveal_it():
    a = ApiKeyAuth([KEY_A, KEY_B])
    ta, tb = a.authenticate(f"Bearer {KEY_A}"), a.authenticate(f"Bearer {KEY_B}")
    assert ta.tenant_id != tb.tenant_id
    assert ta.cache_namespace != tb.cache_namespace
    for tenant, key in [(ta, KEY_A), (tb, KEY_B)]:
        assert tenant.cache_namespace is not None
        for secret_part in [key, key[:8], key[-8:]]:
            assert secret_part not in tenant.tenant_id
            assert secret_part not in tenant.cache_namespace
            assert secret_part not in repr(tenant)
        assert len(tenant.tenant_id) <= 16


def test_tenant_id_is_stable_across_instances_but_namespace_is_per_process_secret():
    t1 = ApiKeyAuth([KEY_A]).authenticate(f"Bearer {KEY_A}")
    t2 = ApiKeyAuth([KEY_A, KEY_B]).authenticate(f"Bearer {KEY_A}")
    assert t1.tenant_id == t2.tenant_id  # dashboards keep their series across restarts
    assert t1.cache_namespace != t2.cache_namespace  # nobody can compute it offline from the key


def test_shared_prefix_cache_keeps_tenant_ids_but_shares_the_namespace():
    a = ApiKeyAuth([KEY_A, KEY_B], share_prefix_cache=True)
    ta, tb = a.authenticate(f"Bearer {KEY_A}"), a.authenticate(f"Bearer {KEY_B}")
    assert ta.tenant_id != tb.tenant_id
    assert ta.cache_namespace is None and tb.cache_namespace is None


def test_client_salt_only_splits_its_own_tenant_namespace():
    a = ApiKeyAuth([KEY_A, KEY_B])
    ta, tb = a.authenticate(f"Bearer {KEY_A}"), a.authenticate(f"Bearer {KEY_B}")
    assert a.namespace_for(ta, None) == ta.cache_namespace
    salted = a.namespace_for(ta, "my-salt")
    assert salted.startswith(ta.cache_namespace + "/")
    assert salted != a.namespace_for(ta, "other-salt")
    # Whatever the client sends, it cannot name another tenant's namespace or leave its own.
    for salt in [tb.cache_namespace, "", "/", "../" + tb.cache_namespace, "my-salt"]:
        ns = a.namespace_for(ta, salt)
        assert ns.startswith(ta.cache_namespace + "/")
        assert ns != tb.cache_namespace and not ns.startswith(tb.cache_namespace)
    assert a.namespace_for(ta, "same") != a.namespace_for(tb, "same")


def test_anonymous_salt_never_equals_a_tenant_namespace():
    anon = ApiKeyAuth([]).authenticate(None)
    tenant = ApiKeyAuth([KEY_A]).authenticate(f"Bearer {KEY_A}")
    assert ApiKeyAuth.namespace_for(anon, None) is None
    ns = ApiKeyAuth.namespace_for(anon, tenant.cache_namespace)
    assert ns is not None and ns != tenant.cache_namespace and not ns.startswith("t:")


@pytest.mark.parametrize(
    "header",
    [f"Bearer {KEY_A}", f"Bearer {KEY_B}", "Bearer " + "x" * 500, "Bearer wrong", None, "Basic a"],
)
def test_every_key_is_compared_in_constant_time_without_early_exit(monkeypatch, header):
    """Counts compare_digest calls instead of timing: robust on a noisy machine (C8 A4)."""
    keys = [KEY_A, "k2", KEY_B, "k4-" + "x" * 100]
    a = ApiKeyAuth(keys)
    calls = []
    real_compare = hmac.compare_digest

    def counting_compare(x, y):
        calls.append((len(x), len(y)))
        return real_compare(x, y)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting_compare)
    accepted = a.authenticate(header) is not None
    assert accepted == (header in (f"Bearer {KEY_A}", f"Bearer {KEY_B}"))
    assert len(calls) == len(keys)
    assert all(lx == ly == 32 for lx, ly in calls)  # fixed-length digests: length never leaks


# -------------------------------------------------------------------------------- rate limits


def test_requests_per_minute_admits_up_to_the_limit_then_asks_to_wait():
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=3, tokens_per_minute=None, clock=clock)
    assert [limiter.check("t", 10) for _ in range(3)] == [None, None, None]
    wait = limiter.check("t", 10)
    assert wait == pytest.approx(20.0)  # one request refills every 60/3 s
    assert limiter.check("other", 10) is None  # tenants have their own buckets
    clock.now += 19.0
    assert limiter.check("t", 10) == pytest.approx(1.0)  # refusals charge nothing
    clock.now += 1.0
    assert limiter.check("t", 10) is None
    assert limiter.check("t", 10) > 0


def test_tokens_per_minute_limit_refills_over_time():
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=None, tokens_per_minute=600, clock=clock)
    assert limiter.check("t", 500) is None
    assert limiter.check("t", 200) == pytest.approx(10.0)  # needs 100 more at 10 tokens/s
    assert limiter.check("t", 100) is None  # the refusal charged nothing
    clock.now += 30.0
    assert limiter.check("t", 300) is None
    assert limiter.check("t", 1) == pytest.approx(0.1)


def test_either_limit_refuses():
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=60, tokens_per_minute=100, clock=clock)
    assert limiter.check("t", 100) is None
    assert limiter.check("t", 1) > 0  # tokens exhausted though requests remain
    clock.now += 60.0
    for _ in range(60):
        assert limiter.check("t", 0) is None
    assert limiter.check("t", 0) == pytest.approx(1.0)  # requests exhausted though tokens remain


def test_request_larger_than_the_budget_runs_when_full_and_leaves_debt():
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=None, tokens_per_minute=100, clock=clock)
    assert limiter.check("t", 250) is None
    assert limiter.check("t", 1) == pytest.approx(90.6)  # from -150 back to 1 at 100/60 per s


def test_no_limits_admit_everything():
    limiter = RateLimiter(None, None)
    assert not limiter.enabled
    assert all(limiter.check("t", 10**9) is None for _ in range(100))


def test_bad_limits_and_token_counts_are_refused():
    with pytest.raises(ValueError):
        RateLimiter(0, None)
    with pytest.raises(ValueError):
        RateLimiter(None, -5)
    with pytest.raises(ValueError):
        RateLimiter(10, None).check("t", -1)


def test_idle_tenants_are_dropped_and_the_tenant_count_is_capped():
    clock = FakeClock()
    limiter = RateLimiter(requests_per_minute=60, tokens_per_minute=None, clock=clock,
                          max_tenants=50)
    for i in range(40):
        limiter.check(f"t{i}", 1)
    assert len(limiter) == 40
    clock.now += 61.0  # every bucket has refilled: each is the same as a fresh one
    limiter.check("new", 1)
    assert len(limiter) == 1
    for i in range(1000):
        limiter.check(f"burst{i}", 1)
    assert len(limiter) == 50
