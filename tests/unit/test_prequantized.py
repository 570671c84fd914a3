"""Checkpoints quantized by AutoAWQ, AutoGPTQ and llm-compressor load into banyan's int4 / int8 with the file's values.

The checkpoints are tiny Llamas packed as those tools pack them (tests/prequantized_factories.py); the reference
is transformers' LlamaForCausalLM holding the float weights w = s * (q - z) the packed tensors stand for.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from banyan import LLM
from banyan.config import EngineConfig, ModelConfig
from banyan.distributed.tensor_parallel import ShardPlan
from banyan.errors import InvalidParameterError, ModelLoadError
from banyan.layers.linear import checkpoint_shards
from banyan.quantization.formats import INT8, WeightFormat
from banyan.quantization.linear import QuantizedLinear
from banyan.quantization.packing import InputOrdered
from banyan.runner.weights import open_model
from tests.factories import write_model_dir
from tests.models.test_logits_vs_transformers import PagedSteps
from tests.prequantized_factories import LAYOUTS, write_prequantized
from tests.unit.test_gguf_compact import without_cpu_kernels  # noqa: F401 (a fixture)
from tests.unit.test_quantization import needs_gemv

SHAPES = {
    "gptq-v2": {"intermediate_size": 256},  # per channel over 256 inputs: 8 of banyan's groups of 32 each
    "gptq-128": {"hidden_size": 192, "intermediate_size": 320},  # groups of 128 + 64 and 2 x 128 + 64
}
METHOD = {name: layout.method for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, float reference model); written once per module."""
    written = {}
    for name in LAYOUTS:
        path = tmp_path_factory.mktemp(name)
        written[name] = path, write_prequantized(path, name, **SHAPES.get(name, {}))
    return written


def load(path, quantization=None) -> nn.Module:
    config = ModelConfig(str(path), num_threads=1, dtype="float32", quantization=quantization)
    return LLM.from_config(EngineConfig(model=config)).engine.runner.model


def reference_weights(reference: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in reference.state_dict().items() if k.endswith("_proj.weight")}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_weight_holds_the_files_values(checkpoints, name):
    """Compact, every value is the file's exactly; so is the float weight (--quantization none)."""
    path, reference = checkpoints[name]
    source = open_model(str(path))
    compact, floats = dict(source.iter_weights(compact=True)), dict(source.iter_weights())
    for key, want in reference_weights(reference).items():
        assert torch.equal(compact[key].dequantize(), want), key
        assert torch.equal(floats[key], want), key
        assert isinstance(compact[key], InputOrdered) == LAYOUTS[name].act_order  # inputs sorted by group
    formats = source.compact_formats()
    int4 = WeightFormat("int4", 32)  # the same values in banyan's groups of 32: its AVX2 kernel's fastest
    assert set(formats.values()) == ({INT8} if name == "w8a8" else {int4})
    assert "lm_head.weight" not in formats  # left in floats by the tools; banyan keeps it so


def layer_weight(reference: dict[str, torch.Tensor], name: str, layer: nn.Module) -> torch.Tensor:
    """The float weight of a banyan layer, merged shards (q/k/v, gate/up) stacked as banyan stacks them."""
    return torch.cat([reference[f"{path}.weight"] for path in checkpoint_shards(name, layer)])


def reference_and_banyan_logits(path, reference, model, prefill=12, decode=4):
    """Logits of one sequence: its first `prefill` tokens as one step, then `decode` steps of one token."""
    vocab = reference.config.vocab_size
    tokens = torch.randint(3, vocab, (prefill + decode,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0]
    steps = PagedSteps(model, model.arch, page_size=16)
    rows = steps.step([(0, tokens[:prefill])]) + [steps.step([(0, [t])])[0] for t in tokens[prefill:]]
    return torch.cat(rows), want


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layers_and_logits_are_the_float_references(checkpoints, name, without_cpu_kernels):  # noqa: F811
    """Dequantizing per matmul: x = I through each layer (GPTQ act-order: x permuted as the weight's inputs are)
    gives W^T to the last bit, and the model gives the reference's logits up to float32's summation order."""
    path, reference = checkpoints[name]
    model, weights = load(path, METHOD[name]), reference_weights(reference)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 4 * reference.config.num_hidden_layers and not isinstance(model.lm_head, QuantizedLinear)
    for layer_name, layer in layers.items():
        identity = torch.eye(layer.in_features)
        assert torch.equal(layer(identity).t(), layer_weight(weights, layer_name, layer)), layer_name
        assert (layer.input_order is not None) == LAYOUTS[name].act_order
    got, want = reference_and_banyan_logits(path, reference, model)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


@needs_gemv
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_default_route_is_within_the_kernels_rounding(checkpoints, name):
    """Unasked, on an AVX2 CPU, as for a GGUF file: rows through banyan's kernel, which rounds x to int8 per block of
    32 inputs (measured 0.4-1.6% of a layer's output on these layers, most where symmetric weights cancel; 3%
    allowed): every row of an int4 layer (the kernel is faster than FBGEMM's fp16 GEMM at any width), and of an int8
    one where the kernel is built for AVX-512 VNNI; with AVX2 alone decode rows of an int8 one, whose prefill takes
    a float16 copy of the same weights (measured under 0.2% at the logits; 1% allowed). These random tiny models
    amplify a layer's error by their logits (0.5% of noise added to each projection moved them 1.7-3.3%): rows through the kernel measured 1.3-6.3% off (the most on the wider gptq-128
    model), so 15% is allowed there, which still catches a layout read wrong (AWQ's nibbles in plain order, or
    act-order without permuting x: 120-150% off)."""
    path, reference = checkpoints[name]
    model, weights = load(path), reference_weights(reference)
    every_row_through_kernel = False
    for layer_name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear) and layer.fmt.kind in ("int4", "int8"):
            every_row_through_kernel |= layer.gemv is not None and layer.wide is None
            x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(1))
            want = x @ layer_weight(weights, layer_name, layer).t()
            assert relative_error(layer(x).flatten(), want.flatten()) < 0.03, layer_name
    got, want = reference_and_banyan_logits(path, reference, model)
    assert relative_error(got[:12], want[:12]).max() < (0.15 if every_row_through_kernel else 0.01)  # the prompt's rows
    assert relative_error(got[12:], want[12:]).max() < 0.15


# -- what banyan refuses, by name --------------------------------------------------------------


def rewrite_config(path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


REFUSED = [  # (layout written, change to its quantization_config, the words the error must hold)
    ("awq", lambda c: c.update(version="gemv"), "AWQ version gemv"),
    ("awq", lambda c: c.update(bits=8), "AWQ 8-bit"),
    ("awq", lambda c: c.update(zero_point=False), "AWQ without zero points"),
    ("gptq", lambda c: c.update(bits=3), "GPTQ 3-bit"),
    ("gptq", lambda c: c.update(group_size=16), "GPTQ group size 16"),
    ("gptq", lambda c: c.update(checkpoint_format="marlin"), "GPTQ checkpoint_format marlin"),
    ("w8a8", lambda c: c.update(format="float-quantized"), "compressed-tensors float8 weights"),
    ("w8a8", lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group"), "strategy group"),
    ("w8a8", lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric int8 weights"),
    ("w8a8", lambda c: c["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "static input activations"),
    ("w8a8", lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ("w8a8", lambda c: c.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
]


@pytest.mark.parametrize("name, change, named", REFUSED, ids=[r[2] for r in REFUSED])
def test_an_unsupported_layout_is_refused_naming_it(tmp_path, name, change, named):
    write_prequantized(tmp_path, name)
    rewrite_config(tmp_path, change)
    with pytest.raises(ModelLoadError, match=named):
        open_model(str(tmp_path))


def test_act_order_shards_of_one_matmul_must_share_their_order(tmp_path):
    """q/k/v see one input, so GPTQ orders them alike; a checkpoint where they differ cannot be one matmul."""
    write_prequantized(tmp_path, "gptq", split_orders=True)
    with pytest.raises(ModelLoadError, match="g_idx"):
        load(tmp_path)


def test_quantization_asked_must_be_the_checkpoints(checkpoints, tmp_path):
    path, _ = checkpoints["awq"]
    with pytest.raises(InvalidParameterError, match="AWQ 4-bit .* int8 would quantize"):
        load(path, "int8")
    with pytest.raises(InvalidParameterError, match="gptq keeps a checkpoint's own gptq tensors; this .* is AWQ"):
        load(path, "gptq")
    write_model_dir(tmp_path)  # a float checkpoint
    with pytest.raises(InvalidParameterError, match="awq keeps a checkpoint's own awq tensors; this checkpoint is not"):
        load(tmp_path, "awq")


def test_none_dequantizes_to_floats(checkpoints):
    path, reference = checkpoints["gptq"]
    model = load(path, "none")
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    weights = reference_weights(reference)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, weights["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_reads_its_slices_of_the_files_values(checkpoints, rank):
    """Column-parallel layers take their output rows, row-parallel ones their inputs by whole groups (of 32 here)."""
    path, reference = checkpoints["awq"]
    source = open_model(str(path))
    plan = ShardPlan(source.arch, 2, rank)
    got = dict(source.iter_weights(compact=True, shard=plan))
    for key, want in reference_weights(reference).items():
        assert torch.equal(got[key].dequantize(), plan(key).take(want)), key


def test_act_order_with_tensor_parallelism_is_refused(checkpoints):
    path, _ = checkpoints["gptq"]
    source = open_model(str(path))
    with pytest.raises(ModelLoadError, match="act-order .* tensor parallelism"):
        list(source.iter_weights(compact=True, shard=ShardPlan(source.arch, 2, 0)))


def test_older_autogptq_keeps_its_config_beside_config_json(tmp_path):
    """quantize_config.json (no quant_method in it) when config.json has no quantization_config."""
    reference = write_prequantized(tmp_path, "gptq")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "quantize_config.json").write_text(json.dumps({k: v for k, v in config.pop("quantization_config").items()
                                                               if k != "quant_method"}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = open_model(str(tmp_path))
    assert source.quantization.method == "gptq" and source.quantization.zeros_minus_one
    weights = dict(source.iter_weights(compact=True))
    for key, want in reference_weights(reference).items():
        assert torch.equal(weights[key].dequantize(), want), key
