"""Everything chosen by name goes through one Registry: lazy imports, one error naming the setting and the choices."""

from __future__ import annotations

import sys

import pytest

from banyan.config import ServerConfig
from banyan.errors import InvalidParameterError
from banyan.layers.activation import get_activation
from banyan.layers.attention import attention_backend_names, get_attention_backend
from banyan.layers.rotary import RotaryEmbedding
from banyan.models.registry import get_model_class
from banyan.quantization import plan_formats
from banyan.registry import Registry, UnknownChoiceError
from banyan.scheduler.policy import SchedulingPolicy
from banyan.structured import BACKENDS
from banyan.tools import format_named


def test_a_path_is_imported_only_when_asked_for():
    registry = Registry("thing")
    registry.register("json", "json:dumps")
    registry.register("absent", "no_such_module_anywhere:f")

    @registry.register("double")
    def double(x):
        return 2 * x

    assert registry.names() == ["json", "absent", "double"] and "absent" in registry
    assert registry.get("json")({}) == "{}" and registry.get("double")(2) == 4
    assert "no_such_module_anywhere" not in sys.modules
    with pytest.raises(ImportError):
        registry.get("absent")


def test_an_unknown_name_names_the_setting_and_the_choices():
    registry = Registry("thing")
    registry.register("a", 1)
    with pytest.raises(UnknownChoiceError, match="thing: unknown 'b'; choose from a") as error:
        registry.get("b")
    assert isinstance(error.value, InvalidParameterError) and error.value.param == "thing"
    assert error.value.choices == ("a",)


@pytest.mark.parametrize("choose, param", [
    (lambda: get_attention_backend("flash"), "attention_backend"),
    (lambda: get_model_class("GPT2LMHeadModel"), "architecture"),
    (lambda: BACKENDS.get("outlines"), "structured_output_backend"),
    (lambda: format_named("mistral"), "tool_call_parser"),
    (lambda: ServerConfig(tool_call_parser="mistral"), "tool_call_parser"),
    (lambda: RotaryEmbedding(8, 16, rope_scaling={"rope_type": "dynamic"}), "rope_scaling"),
    (lambda: get_activation("relu2"), "hidden_act"),
    (lambda: SchedulingPolicy("lifo"), "policy"),
    (lambda: plan_formats(None, "int3"), "quantization"),
])
def test_every_registry_raises_the_same_error(choose, param):
    with pytest.raises(UnknownChoiceError) as error:
        choose()
    assert error.value.param == param and error.value.choices


def test_attention_backends_say_why_they_cannot_run(monkeypatch):
    import torch

    assert attention_backend_names() == ["torch", "triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidParameterError, match="needs a CUDA device"):
        get_attention_backend("triton", torch.device("cpu"))
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
