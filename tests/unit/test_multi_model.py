"""Several models in one server, the parts that need no server: which flags reach which model, engine_args
checked against the settings table, the memory estimate and budget, A/B route choice, merged metrics."""

from __future__ import annotations

import math

import pytest

from banyan.checkpoint import open_checkpoint
from banyan.cli import build_parser
from banyan.config import EngineConfig, ModelArch
from banyan.errors import InvalidParameterError
from banyan.ipc.messages import EngineStats
from banyan.server.errors import APIError
from banyan.server.metrics import ServerMetrics, render_all
from banyan.server.model_memory import (
    GiB,
    Holding,
    MemoryBudget,
    MemoryBudgetExceededError,
    MemoryEstimate,
    MiB,
    estimate_memory,
    num_parameters,
)
from banyan.server.model_specs import engine_from_args, models_to_serve, specs_from_yaml
from banyan.server.routing import make_route, parse_route, sticky_point
from tests.factories import make_hf_model, write_model_dir

PARSER = build_parser()


def specs_of(*argv: str):
    argv = ["serve", *argv]
    args = PARSER.parse_args(argv)
    args.argv = argv
    return models_to_serve(PARSER, args)


# -- which flags reach which model ----------------------------------------------------------------
def test_one_model_means_what_it_always_meant():
    (spec,), routes = specs_of("--max-model-len", "256", "--model", "/m", "--served-model-name", "a,b", "--port", "1")
    assert spec.names == ("a", "b") and spec.engine.model.model == "/m" and spec.engine.model.max_model_len == 256
    assert routes == []


def test_flags_after_a_model_apply_to_that_model_only():
    (a, b), _ = specs_of("--block-size", "8", "--model", "/a", "--served-model-name", "A", "--max-model-len", "128",
                    "--model", "/b", "--served-model-name", "B", "--kv-cache-memory", "64MiB")
    assert (a.name, a.source, b.name, b.source) == ("A", "/a", "B", "/b")
    assert a.engine.cache.block_size == b.engine.cache.block_size == 8  # common: before the first --model
    assert a.engine.model.max_model_len == 128 and b.engine.model.max_model_len is None
    assert b.engine.cache.kv_cache_memory == 64 * MiB and a.engine.cache.kv_cache_memory is None


def test_two_models_under_one_name_are_refused():
    with pytest.raises(InvalidParameterError, match="'x' names two models"):
        specs_of("--model", "/a", "--served-model-name", "x", "--model", "/b", "--served-model-name", "x")


def test_models_yaml_gives_names_engine_args_shares_and_routes(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n"
                    "  - {name: chat, model: /a, engine_args: {max_model_len: 512, kv_cache_memory: 32MiB}}\n"
                    "  - {name: [tiny, tiny-v1], model: /b, memory_share: 0.25}\n"
                    "routes:\n  assistant: {chat: 90, tiny: 10}\n")
    file = specs_from_yaml(str(path), EngineConfig())
    chat, tiny = file.models
    assert chat.engine.model.max_model_len == 512 and chat.engine.cache.kv_cache_memory == 32 * MiB
    assert tiny.names == ("tiny", "tiny-v1") and tiny.memory_share == 0.25
    assert file.routes == {"assistant": {"chat": 90, "tiny": 10}}
    (_, spec_b), (route,) = specs_of("--models", str(path), "--block-size", "8")
    assert spec_b.engine.cache.block_size == 8 and route.variants == (("chat", 90.0), ("tiny", 10.0))


@pytest.mark.parametrize("entry, param", [
    ("{name: a, model: /a, memory_share: 2}", "models[0].memory_share"),
    ("{name: a, model: /a, engine_args: {max_num_seq: 4}}", "models[0].engine_args.max_num_seq"),
    ("{name: a, model: /a, colour: red}", "models[0].colour"),
    ("{model: /a}", "models[0].name"),
])
def test_a_bad_models_yaml_names_the_field(tmp_path, entry, param):
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - {entry}\n")
    with pytest.raises(InvalidParameterError) as e:
        specs_from_yaml(str(path), EngineConfig())
    assert e.value.param == param


# -- engine_args ----------------------------------------------------------------------------------
def test_engine_args_go_through_the_settings_table():
    config = engine_from_args(EngineConfig(), "/m", {"max_model_len": 128, "kv_cache_memory": "1GiB", "dtype": "float32",
                                                     "gpu_memory_utilization": 1, "enable_prefix_caching": False})
    assert config.model.model == "/m" and config.model.max_model_len == 128 and config.cache.kv_cache_memory == GiB
    assert config.cache.gpu_memory_utilization == 1.0 and config.cache.enable_prefix_caching is False


@pytest.mark.parametrize("args, param, words", [
    ({"max_modle_len": 1}, "engine_args.max_modle_len", "did you mean 'max_model_len'"),
    ({"max_model_len": "128"}, "engine_args.max_model_len", "must be an integer"),
    ({"max_model_len": True}, "engine_args.max_model_len", "must be an integer"),
    ({"kv_cache_memory": "lots"}, "engine_args.kv_cache_memory", "not a size"),
    ({"block_size": 3}, "engine_args.block_size", "power of two"),
    ({"enable_prefix_caching": "yes"}, "engine_args.enable_prefix_caching", "true or false"),
    ({"model": "/other"}, "engine_args.model", "not an engine setting"),
    ({"speculative_config": 3}, "engine_args.speculative_config", "must be an object"),
])
def test_bad_engine_args_name_the_field(args, param, words):
    with pytest.raises(InvalidParameterError) as e:
        engine_from_args(EngineConfig(), "/m", args)
    assert e.value.param == param and words in str(e.value)


# -- memory ---------------------------------------------------------------------------------------
def test_the_parameter_count_is_the_models():
    for arch, overrides in [("qwen3", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True, "mlp_bias": True})]:
        model = make_hf_model(arch, **overrides)
        shape = ModelArch.from_hf_config(model.config.to_dict())
        assert num_parameters(shape) == sum(p.numel() for p in model.parameters()), arch


def test_the_estimate_counts_weights_kv_cache_and_the_process(tmp_path):
    write_model_dir(tmp_path, "llama")
    checkpoint = open_checkpoint(str(tmp_path))
    engine = engine_from_args(EngineConfig(), str(tmp_path), {"kv_cache_memory": "64MiB", "dtype": "float32"})
    estimate = estimate_memory(engine, checkpoint.arch, tmp_path, on_gpu=False)
    assert estimate.weights == 4 * num_parameters(checkpoint.arch) and estimate.kv_cache == 64 * MiB
    assert estimate.process > 0 and estimate.total == estimate.weights + estimate.kv_cache + estimate.process


def test_a_load_beyond_the_budget_is_refused_with_the_numbers():
    budget = MemoryBudget(2 * GiB)
    loaded = [Holding("a", 1 * GiB, resident=512 * MiB), Holding("b", 256 * MiB, resident=600 * MiB)]
    budget.check("c", MemoryEstimate(weights=100 * MiB, kv_cache=100 * MiB, process=100 * MiB), loaded, on_gpu=False)
    with pytest.raises(MemoryBudgetExceededError) as e:
        budget.check("c", MemoryEstimate(weights=0, kv_cache=400 * MiB, process=100 * MiB), loaded, on_gpu=False)
    message = str(e.value)  # a: its estimate counts; b: what it holds, more than its estimate
    assert "'c' needs 0.49 GiB" in message and "only 0.41 GiB is free" in message
    assert "--memory-budget 2.00 GiB" in message and "a 1.00 GiB, b 0.59 GiB" in message
    assert e.value.status == 409 and e.value.code == "memory_budget_exceeded"


# -- A/B routes -----------------------------------------------------------------------------------
def test_a_90_10_route_over_1000_users_lands_within_binomial_bounds():
    route = parse_route("chat=modelA:90,modelB:10")
    n = 1000
    to_b = sum(route.choose(f"user:{i}") == "modelB" for i in range(n))
    sd = math.sqrt(n * 0.1 * 0.9)  # 9.5
    assert abs(to_b - 100) <= 4 * sd, to_b  # [62, 138]: a fair coin of p = 0.1 leaves it once in ~16,000 runs


def test_one_user_sees_one_variant_and_a_weight_change_moves_only_the_users_it_must():
    before, after = parse_route("chat=a:90,b:10"), parse_route("chat=a:80,b:20")
    users = [f"user:{i}" for i in range(1000)]
    first = {u: before.choose(u) for u in users}
    assert all(before.choose(u) == first[u] for u in users)  # sticky
    moved = [u for u in users if after.choose(u) != first[u]]
    assert all(first[u] == "a" for u in moved)  # b's users stay on b; some of a's move to b
    assert all(0.8 <= sticky_point("chat", u) < 0.9 for u in moved)


def test_a_route_chooses_among_the_variants_that_can_serve():
    route = parse_route("chat=a:50,b:50")
    assert {route.choose(f"u{i}", available={"b"}) for i in range(50)} == {"b"}
    with pytest.raises(LookupError):
        route.choose("u", available=set())


@pytest.mark.parametrize("text", ["chat", "chat=a", "chat=a:x", "chat=a:-1", "chat=a:0", "bad name=a:1", "=a:1"])
def test_malformed_routes_are_refused(text):
    with pytest.raises(InvalidParameterError):
        parse_route(text)


def test_a_weight_of_zero_takes_a_variant_out():
    assert make_route("r", {"a": 0, "b": 3}).variants == (("b", 3.0),)


# -- metrics --------------------------------------------------------------------------------------
def stats(kv_usage: float) -> EngineStats:
    return EngineStats(time=0.0, num_steps=1, num_running=0, num_waiting=0, kv_usage=kv_usage, num_pages=8,
                       num_free_pages=8, prefix_query_tokens=0, prefix_hit_tokens=0, num_preemptions=0)


def test_metrics_of_several_models_are_one_family_each_with_a_series_per_model():
    a, b = ServerMetrics("a", max_model_len=64), ServerMetrics("b", max_model_len=64)
    a.update_from_engine_stats(stats(0.5))
    b.update_from_engine_stats(stats(0.25))
    text = render_all([a, b])[0].decode()
    assert text.count("# TYPE banyan:kv_cache_usage_perc gauge") == 1
    assert 'banyan:kv_cache_usage_perc{model_name="a"} 0.5' in text
    assert 'banyan:kv_cache_usage_perc{model_name="b"} 0.25' in text
    assert 'vllm:kv_cache_usage_perc{model_name="b"} 0.25' in text
    assert render_all([a])[0] == a.render()[0]


# -- bench swap's arithmetic ------------------------------------------------------------------------
def test_the_swap_window_measures_the_longest_gap_between_anyones_tokens():
    from banyan.bench.metrics import RequestTiming
    from banyan.bench.swap import Stream, _window

    a = Stream(10.0, RequestTiming(success=True, ttft=0.5, itl=[0.1, 0.1]))  # tokens at 10.5, 10.6, 10.7
    b = Stream(10.2, RequestTiming(success=True, ttft=1.0, itl=[0.2]))  # 11.2, 11.4
    c = Stream(10.9, RequestTiming(success=False, error="HTTP 503"))
    w = _window([a, b, c], 10.0, 12.0)
    assert w["tokens"] == 5 and w["longest_gap_ms"] == 600.0  # 12.0 - 11.4 (the window's end counts)
    assert w["requests_started"] == 3 and w["failed"] == 1 and w["ttft_p50_ms"] == 750.0
    assert _window([a, b, c], 11.0, 11.3)["tokens"] == 1


# -- the registry before any core starts: names, shares, the budget ----------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_registry")
    write_model_dir(path, "llama")
    return path


def registry(budget: int | None):
    from banyan.config import ServerConfig
    from banyan.server.models import ModelRegistry

    def never(*args):  # these tests accept or refuse loads; no core is started
        raise AssertionError("no core should start here")

    return ModelRegistry(ServerConfig(), EngineConfig(), MemoryBudget(budget), never, never)


def test_a_memory_share_sizes_the_kv_cache_from_what_the_share_leaves(tiny_dir):
    import asyncio

    from banyan.server.model_specs import ModelSpec

    models = registry(2 * GiB)
    spec = ModelSpec(("a",), engine_from_args(EngineConfig(), str(tiny_dir), {"dtype": "float32"}), memory_share=0.25)
    entry = asyncio.run(models._accepted(spec))
    kv = entry.spec.engine.cache.kv_cache_memory
    assert kv == GiB // 2 - entry.estimate.weights - entry.estimate.process and entry.estimate.total == GiB // 2
    too_small = ModelSpec(("b",), spec.engine, memory_share=0.01)  # 20 MiB: less than the core's own process
    with pytest.raises(APIError) as e:
        asyncio.run(models._accepted(too_small))
    assert e.value.status == 409 and e.value.param == "memory_share"


def test_the_budget_counts_the_models_already_accepted(tiny_dir):
    import asyncio

    from banyan.server.model_specs import ModelSpec

    models = registry(1 * GiB)
    engine = engine_from_args(EngineConfig(), str(tiny_dir), {"kv_cache_memory": "300MiB"})
    first = asyncio.run(models._accepted(ModelSpec(("a",), engine)))  # about 620 MiB with its process
    models.entries["a"] = first
    with pytest.raises(MemoryBudgetExceededError, match="loaded: a 0.6"):
        asyncio.run(models._accepted(ModelSpec(("b",), engine)))


def test_a_route_is_sticky_per_user_field_else_per_key():
    from banyan.server.auth import ANONYMOUS, Tenant
    from banyan.server.models import sticky_user

    tenant = Tenant(tenant_id="t-1", cache_namespace="t-1")
    assert sticky_user({"user": "alice"}, tenant) == "user:alice"
    assert sticky_user({}, tenant) == sticky_user({"user": ""}, tenant) == "tenant:t-1"
    assert sticky_user({"user": 5}, ANONYMOUS) is None  # nobody to stick to: chosen at random


def test_requests_without_a_model_go_to_the_first_model_still_served(tiny_dir):
    import asyncio

    from banyan.server.model_entry import ModelState
    from banyan.server.model_specs import ModelSpec

    models = registry(None)
    engine = engine_from_args(EngineConfig(), str(tiny_dir), {"kv_cache_memory": "16MiB"})
    a, b = (asyncio.run(models._accepted(ModelSpec((name,), engine), check_memory=False)) for name in "ab")
    for entry in (a, b):
        entry.state = ModelState.READY
        models.entries[entry.name] = entry
    models.primary = "a"
    assert models.resolve(None, None) == (a, None)
    models._forget(a)  # unloaded
    assert models.resolve(None, None) == (b, None) and models.primary == "b"
    models._forget(b)
    with pytest.raises(APIError) as e:
        models.resolve(None, None)
    assert e.value.status == 404
