"""PEFT adapters are checked against the base model before a tensor is read: every way a file can be wrong is a
LoRAAdapterError that names the problem; a good one maps onto banyan's fused layers with the right scale."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from banyan.checkpoint import open_checkpoint
from banyan.errors import LoRAAdapterError
from banyan.lora.adapter import read_adapter
from banyan.lora.weights import load_adapter_weights
from tests.factories import write_model_dir
from tests.lora_factories import write_adapter

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapter")
    base = write_model_dir(root / "model", "llama", seed=1)
    write_adapter(root / "good", base, rank=8, alpha=16)
    write_adapter(root / "rs", base, rank=4, alpha=8, targets=["k_proj", "up_proj"], rslora=True)
    return root, open_checkpoint(str(root / "model")).arch


def copy_of(tiny, tmp_path, name="good"):
    root, _ = tiny
    shutil.copytree(root / name, tmp_path / name)
    return tmp_path / name


def edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def edit_tensors(path, change):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def refused(path, arch, max_rank=16) -> str:
    with pytest.raises(LoRAAdapterError) as info:
        read_adapter(path, arch, max_rank)
    assert info.value.param == "lora_path" and info.value.status == 400
    return str(info.value)


def test_a_peft_adapter_is_read_with_its_scale(tiny):
    root, arch = tiny
    spec = read_adapter(root / "good", arch, 16)
    assert spec.rank == 8 and spec.scale == 16 / 8
    assert spec.target_modules == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert len(spec.tensors) == 7 * arch.num_hidden_layers
    rs = read_adapter(root / "rs", arch, 16)
    assert rs.scale == pytest.approx(8 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)


def test_tensors_land_in_the_fused_layers_with_the_scale_folded_into_b(tiny):
    root, arch = tiny
    spec = read_adapter(root / "rs", arch, 16)
    weights = load_adapter_weights(spec, torch.float32)
    raw = load_file(str(root / "rs" / "adapter_model.safetensors"))
    qkv = weights.modules["model.layers.1.self_attn.qkv_proj"]
    assert set(qkv) == {"k_proj"}  # q and v are not targets: no entry
    a, b = qkv["k_proj"]
    assert torch.equal(a, raw[f"{PREFIX}.1.self_attn.k_proj.lora_A.weight"])
    torch.testing.assert_close(b, raw[f"{PREFIX}.1.self_attn.k_proj.lora_B.weight"] * spec.scale)
    assert set(weights.modules["model.layers.0.mlp.gate_up_proj"]) == {"up_proj"}
    assert "model.layers.0.self_attn.o_proj" not in weights.modules


def test_rank_above_the_maximum_is_refused(tiny):
    root, arch = tiny
    assert "rank 8 exceeds --max-lora-rank 4" in refused(root / "good", arch, max_rank=4)


def test_a_pickle_is_refused_even_beside_safetensors(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    (path / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    assert "adapter_model.bin, a pickle file" in refused(path, tiny[1])


def test_missing_files_are_named(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    (path / "adapter_config.json").unlink()
    assert "no adapter_config.json" in refused(path, tiny[1])
    path = copy_of(tiny, tmp_path / "x")
    (path / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in refused(path, tiny[1])
    assert "not a directory" in refused(tmp_path / "nowhere", tiny[1])


def test_wrong_shapes_are_refused(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    name = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
    edit_tensors(path, lambda t: t.update({name: torch.zeros(t[name].shape[0] + 1, 8)}))
    message = refused(path, tiny[1])
    assert name in message and "expected [65, 8]" not in message and "expected [64, 8]" in message


def test_a_config_rank_that_disagrees_with_the_tensors_is_refused(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    edit_config(path, r=4)
    assert "has shape [8, 128], expected [4, 128] (r=4)" in refused(path, tiny[1])


def test_unknown_target_modules_are_refused(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    edit_config(path, target_modules=["q_proj", "lm_head"])
    assert "unknown target modules ['lm_head']" in refused(path, tiny[1])
    path = copy_of(tiny, tmp_path / "x")
    edit_tensors(path, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}))
    assert "lm_head.lora_A.weight' is not a LoRA A/B weight of a known target" in refused(path, tiny[1])


def test_unpaired_and_out_of_range_tensors_are_refused(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    edit_tensors(path, lambda t: t.pop(f"{PREFIX}.1.mlp.down_proj.lora_B.weight"))
    assert "unpaired: ['layer 1 down_proj']" in refused(path, tiny[1])
    path = copy_of(tiny, tmp_path / "x")
    edit_tensors(path, lambda t: t.update({f"{PREFIX}.7.mlp.down_proj.lora_A.weight": torch.zeros(8, 128)}))
    assert "the model has 2 layers" in refused(path, tiny[1])


@pytest.mark.parametrize("change, named", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "only LORA adapters"),
    ({"r": 0}, "r must be a positive integer"),
    ({"lora_alpha": "big"}, "lora_alpha must be a number"),
])
def test_unsupported_configs_are_refused(tiny, tmp_path, change, named):
    path = copy_of(tiny, tmp_path)
    edit_config(path, **change)
    assert named in refused(path, tiny[1])


def test_a_corrupt_safetensors_file_is_refused(tiny, tmp_path):
    path = copy_of(tiny, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    assert "not a valid safetensors file" in refused(path, tiny[1])
    (path / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in refused(path, tiny[1])
