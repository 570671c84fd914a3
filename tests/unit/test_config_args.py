"""One table of engine settings: the same names and values through the CLI, LLM's keywords and bench's launcher."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from banyan.bench.plan import CompareConfig
from banyan.cli import build_parser
from banyan.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from banyan.config_args import SETTINGS, config_from_args, config_from_kwargs, engine_config, engine_flags
from banyan.errors import InvalidParameterError
from banyan.frontend.llm import LLM
from banyan.spec.config import SpeculativeConfig


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_every_engine_field_is_one_setting():
    sections = (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig), ("parallel", ParallelConfig),
                ("lora", LoRAConfig))
    fields = [(s, f.name) for s, cls in sections for f in dataclasses.fields(cls)]
    assert sorted((s.section, s.field) for s in SETTINGS.values()) == sorted(fields)
    assert SETTINGS["scheduling_policy"].field == "policy"


def test_keywords_reach_their_sections_including_the_newest_fields():
    config = config_from_kwargs({"model": "m", "max_model_len": 64, "batch_invariant": True, "num_pages": 8,
                                 "structured_output_cache_size": 7, "scheduling_policy": "priority"})
    assert config == EngineConfig(ModelConfig("m", max_model_len=64, batch_invariant=True, structured_output_cache_size=7),
                                  CacheConfig(num_pages=8), SchedulerConfig(policy="priority"))


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_modle_len'.*'max_model_len'"):
        LLM("unused", max_modle_len=64)
    with pytest.raises(InvalidParameterError, match="data_parallel_size"):
        LLM("unused", data_parallel_size=2)


def test_sizes_take_the_same_text_from_python_as_on_the_command_line():
    assert config_from_kwargs({"model": "m", "kv_cache_memory": "128MiB"}).cache.kv_cache_memory == 128 << 20
    assert config_from_kwargs({"kv_cache_memory": "1GB"}).cache.kv_cache_memory == 1_000_000_000
    assert config_from_kwargs({"kv_cache_memory": 4096}).cache.kv_cache_memory == 4096
    with pytest.raises(InvalidParameterError, match="kv_cache_memory: not a size: 'lots'"):
        config_from_kwargs({"kv_cache_memory": "lots"})


@pytest.mark.parametrize("name, value, message", [
    ("max_num_seqs", "8", "max_num_seqs: must be an integer, got '8'"),
    ("max_num_seqs", 8.0, "max_num_seqs: must be an integer, got 8.0"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching: must be True or False, got 'yes'"),
    ("seed", "x", "seed: must be an integer or None, got 'x'"),
    ("kv_cache_memory", True, "kv_cache_memory: must be an integer or None, got True"),
    ("gpu_memory_utilization", "0.5", "gpu_memory_utilization: must be a number, got '0.5'"),
    ("num_threads", -2, "num_threads: must be a positive number of threads, got -2"),
])
def test_a_keyword_of_the_wrong_type_is_an_error_naming_it(name, value, message):
    with pytest.raises(InvalidParameterError, match=re.escape(message)):
        config_from_kwargs({"model": "m", name: value})


def test_keywords_of_the_right_type_pass_as_they_are():
    config = config_from_kwargs({"model": "m", "gpu_memory_utilization": 1, "max_model_len": "auto", "num_pages": None,
                                 "enable_prefix_caching": False, "num_threads": 0})
    assert config.cache.gpu_memory_utilization == 1 and config.model.max_model_len == "auto"
    assert config.cache.enable_prefix_caching is False and config.model.num_threads == 0


def test_flags_and_keywords_build_the_same_config():
    args = parse("--model", "m", "--max-model-len", "64", "--kv-cache-memory", "1MiB", "--no-enable-prefix-caching",
                 "--policy", "priority", "--structured-outputs-config", '{"disable_any_whitespace": false}',
                 "--batch-invariant")
    assert engine_config(args) == config_from_kwargs({
        "model": "m", "max_model_len": 64, "kv_cache_memory": 1 << 20, "enable_prefix_caching": False,
        "scheduling_policy": "priority", "structured_outputs_config": {"disable_any_whitespace": False},
        "batch_invariant": True})
    assert engine_config(parse("--scheduling-policy", "priority")).scheduler.policy == "priority"


def test_engine_flags_rebuild_every_kind_of_value():
    config = engine_config(parse("--model", "m", "--dtype", "float32", "--gpu-memory-utilization", "0.5",
                                 "--structured-outputs-config", '{"disable_any_whitespace": false}',
                                 "--no-enable-jump-forward", "--scheduling-policy", "priority"))
    assert engine_config(parse(*engine_flags(config))) == config
    assert engine_flags(EngineConfig()) == []
    unseeded = engine_config(parse("--model", "m", "--seed", "none"))
    assert unseeded.model.seed is None and engine_config(parse(*engine_flags(unseeded))) == unseeded


def test_speculative_config_is_one_json_object_on_every_surface():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}'
    config = engine_config(parse("--model", "m", "--speculative-config", text))
    assert config == config_from_kwargs({"model": "m", "speculative_config": json.loads(text)})
    assert config.speculative == SpeculativeConfig("ngram", 3, policy="fixed")
    assert engine_config(parse(*engine_flags(config))) == config
    assert engine_config(parse("--model", "m")).speculative is None
    with pytest.raises(InvalidParameterError) as e:
        config_from_kwargs({"speculative_config": {"method": "ngram", "num_speculative_tokens": 17}})
    assert e.value.param == "num_speculative_tokens"


def test_repeatable_flags_keep_their_default_unless_given():
    args = build_parser().parse_args(["bench", "compare", "--concurrencies", "2", "--concurrencies", "8"])
    cfg = config_from_args(CompareConfig, args)
    assert cfg.concurrencies == (2, 8) and cfg.peers == CompareConfig().peers


def _subparsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_every_commands_help_prints_whatever_its_docstrings_say():
    """argparse %-formats help text: a docstring saying "5% w" once made every --help a ValueError."""
    parser = build_parser()
    commands = [parser, *_subparsers(parser)]
    assert len(commands) > 5
    for command in commands:
        assert command.format_help()
