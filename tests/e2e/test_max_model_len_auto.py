"""--max-model-len auto: the longest context one request's K/V can fill in the pool, at most the model's."""

from __future__ import annotations

import logging

import pytest

from banyan.cli import build_parser
from banyan.config_args import config_from_kwargs, engine_config, engine_flags
from banyan.engine.engine import Engine
from banyan.errors import BanyanError, InvalidParameterError
from banyan.sampling_params import SamplingParams
from tests.factories import write_model_dir

MODEL_LIMIT = 512  # the tiny model's max_position_embeddings (tests/factories.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto_len")
    write_model_dir(path, "llama", seed=2)
    return path


def engine(model_dir, **kwargs) -> Engine:
    return Engine(config_from_kwargs(dict(model=str(model_dir), block_size=4, num_threads=1, max_model_len="auto",
                                          **kwargs)))


def test_a_small_cache_sets_the_context_to_what_it_holds(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="banyan.runner.memory"):
        small = engine(model_dir, kv_cache_memory=48 * 1024)
    pool_tokens = small.runner.num_pages * 4
    assert small.max_model_len == pool_tokens < MODEL_LIMIT
    assert f"max_model_len auto: {pool_tokens} tokens (the model allows {MODEL_LIMIT}" in caplog.text

    # One request may fill the whole pool, and no more.
    small.add_request("fits", [5] * (pool_tokens - 1), SamplingParams(max_tokens=1, ignore_eos=True))
    while small.has_unfinished_requests():
        small.step()
    with pytest.raises(BanyanError, match=str(pool_tokens)):
        small.add_request("too-long", [5] * pool_tokens, SamplingParams(max_tokens=1))
    small.close()


def test_a_large_cache_keeps_the_models_own_context(model_dir):
    large = engine(model_dir, kv_cache_memory=64 * 1024 * 1024)
    assert large.runner.num_pages * 4 > MODEL_LIMIT and large.max_model_len == MODEL_LIMIT
    large.close()


def test_auto_is_a_flag_value_and_anything_else_is_refused():
    args = build_parser().parse_args(["serve", "--max-model-len", "auto"])
    config = engine_config(args)
    assert config.model.max_model_len == "auto"
    assert engine_flags(config)[-2:] == ["--max-model-len", "auto"]
    assert engine_config(build_parser().parse_args(["serve", "--max-model-len", "2048"])).model.max_model_len == 2048
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "big"])
    for bad in ("big", 0):
        with pytest.raises(InvalidParameterError, match="max_model_len"):
            config_from_kwargs({"max_model_len": bad})
