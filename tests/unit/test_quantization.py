"""Quantized linear layers against the float32 linear they replace, kernel by kernel."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from banyan.errors import InvalidParameterError
from banyan.quantization import plan_formats, quantize_linears, use_fixed_order, why_not_invariant_by_default
from banyan.quantization.formats import FP8, INT8, Int4Weight, Int8Weight, WeightFormat
from banyan.kernels import cpu_gemv
from banyan.quantization.linear import (BF16_ROWS, FixedOrderLinear, QuantizedLinear, bf16_linear, onednn_blocked,
                                       packed_int_kernels_fast)

INT4_64 = WeightFormat("int4", 64)


def make_layer(fmt, w, packed=None, out_sizes=None, gemv=False, wide_fp16=False):
    """gemv=False: banyan's AVX2 kernel is left out, so a few rows take the path under test."""
    layer = QuantizedLinear(w.shape[1], w.shape[0], fmt, packed_kernels=packed, out_sizes=out_sizes)
    layer.wide_fp16, layer.cpu_kernel = wide_fp16, gemv
    layer.load_weight(slice(0, None), w, "w")
    layer.finish_loading()
    return layer


needs_gemv = pytest.mark.skipif(cpu_gemv.load() is None or not cpu_gemv.vector_cpu(),
                                reason="banyan's CPU kernel needs AVX2 and a C compiler")


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture
def weight_and_input():
    torch.manual_seed(0)
    return torch.randn(96, 256) * 0.05, torch.randn(5, 256)


@pytest.mark.parametrize(
    "fmt, packed, tolerance",
    [
        (INT8, True, 0.01),  # torch._weight_int8pack_mm
        (INT8, False, 0.01),  # dequantize, matmul
        (WeightFormat("int4", 32), True, 0.1),  # torch._weight_int4pack_mm_for_cpu
        (WeightFormat("int4", 32), False, 0.1),
        (INT4_64, True, 0.12),
        (WeightFormat("int4", 128), False, 0.15),
        (FP8, None, 0.06),  # torch._scaled_mm with per-token fp8 inputs (it runs on CPU in torch 2.13)
    ],
)
def test_quantized_linear_is_close_to_float32(weight_and_input, fmt, packed, tolerance):
    w, x = weight_and_input
    assert relative_error(make_layer(fmt, w, packed)(x), F.linear(x, w)) < tolerance


@pytest.mark.parametrize("fmt", [INT8, INT4_64])
def test_packed_kernel_and_dequantize_agree(weight_and_input, fmt):
    """Same quantized values, two kernels: they differ by float rounding only."""
    w, x = weight_and_input
    packed, dequantized = make_layer(fmt, w, packed=True)(x), make_layer(fmt, w, packed=False)(x)
    torch.testing.assert_close(packed, dequantized, rtol=1e-4, atol=1e-4)


def test_fp8_scaled_mm_is_close_to_its_dequantized_reference(weight_and_input):
    w, x = weight_and_input
    layer = make_layer(FP8, w)
    assert layer._matmul == layer._fp8_scaled_mm
    reference = F.linear(x, layer.weight.dequantize())  # fp8 weights, float inputs
    assert relative_error(layer(x), reference) < 0.05  # the rest is the inputs' fp8 rounding


def test_dequantized_matmul_in_chunks_equals_one_matmul(monkeypatch, weight_and_input):
    w, x = weight_and_input
    whole = make_layer(INT8, w, packed=False)(x)
    monkeypatch.setattr("banyan.quantization.linear._CPU_CHUNK_VALUES", 256 * 7)  # 7 rows a block, 14 blocks
    torch.testing.assert_close(make_layer(INT8, w, packed=False)(x), whole)


@pytest.mark.parametrize("fmt", [INT8, INT4_64, FP8])
def test_shards_quantized_one_by_one_equal_the_whole_matrix(weight_and_input, fmt):
    """Scales are per row, so q/k/v quantized as they arrive equal the merged matrix quantized at once."""
    w, x = weight_and_input
    merged = QuantizedLinear(256, 96, fmt, out_sizes={"q_proj": 64, "k_proj": 16, "v_proj": 16}, packed_kernels=False)
    merged.load_weight(slice(0, 64), w[:64], "q")
    merged.load_weight(slice(64, 80), w[64:80], "k")
    merged.load_weight(slice(80, 96), w[80:], "v")
    merged.cpu_kernel = False
    merged.finish_loading()
    torch.testing.assert_close(merged(x), make_layer(fmt, w, packed=False)(x))


@needs_gemv
@pytest.mark.parametrize("fmt", [INT8, WeightFormat("int4", 32), INT4_64, WeightFormat("int4", 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_cpu_gemv_is_close_to_the_dequantized_matmul(weight_and_input, fmt, rows):
    """The AVX2 kernel multiplies the same weight values by x rounded to int8 per block of 32 (llama.cpp's
    way): within 3% (in norm) of the float matmul by the dequantized weight, every row count it takes (8)."""
    w, _ = weight_and_input
    torch.manual_seed(rows)
    x = torch.randn(rows, 256)
    layer = make_layer(fmt, w, packed=False, gemv=True)
    assert layer.gemv is not None
    values = make_layer(fmt, w, packed=False)  # the same weight on the dequantizing path
    reference = F.linear(x, values.weight.dequantize() if fmt == INT8 else _int4_values(values))
    error = relative_error(layer(x), reference)
    # 0.4-0.6% for int8 and int4 alike (int4's offsets take the rounded x's sums); not 0: the kernel answered
    assert 0 < error < 0.03


def _int4_values(layer):
    """The float weight an int4 layer holds, through its dequantizing path (x = I gives W^T)."""
    assert layer.gemv is None
    return layer(torch.eye(layer.in_features)).t()


@needs_gemv
def test_avx2s_int8_kernel_takes_a_few_rows_and_the_float16_copy_the_rest(weight_and_input, monkeypatch):
    """Built for AVX2, the int8 kernel measured about level with FBGEMM's fp16 GEMM on wide batches, so a layer
    asked for a float16 copy keeps one for them (the AVX2 build runs on any CPU these kernels serve)."""
    avx2 = cpu_gemv.CpuKernels(ctypes.CDLL(str(cpu_gemv.build(shutil.which("cc"), "avx2"))), "avx2")
    monkeypatch.setattr(cpu_gemv, "load", lambda: avx2)
    w, _ = weight_and_input
    layer = make_layer(INT8, w, packed=False, gemv=True, wide_fp16=True)
    assert layer.gemv is avx2 and layer.wide is not None
    values = make_layer(INT8, w, packed=False).weight.dequantize()
    wide = torch.randn(layer.gemv.max_rows + 1, 256)
    torch.testing.assert_close(layer(wide), F.linear(wide, values.half().float()), rtol=1e-4, atol=1e-4)
    assert layer.quantized_bytes() > 256 * 96 * 2  # the float16 copy is counted


@pytest.mark.skipif(cpu_gemv.load() is None or cpu_gemv.load().isa != "avx512_vnni",
                    reason="the int8 kernel takes every width where it is built for AVX-512 VNNI")
def test_vnnis_int8_kernel_takes_every_width_and_keeps_no_float16_copy(weight_and_input):
    """With vpdpbusd the int8 kernel is 2-2.6x FBGEMM's fp16 GEMM from 16 rows on (a Zen 4), so a wide batch's rows
    are the kernel's too (each row's bits as alone), and the layer holds the int8 weight once."""
    w, _ = weight_and_input
    layer = make_layer(INT8, w, packed=False, gemv=True, wide_fp16=True)
    assert layer.wide is None and layer.weight.q is None
    wide = torch.randn(layer.gemv.max_rows + 5, 256)
    assert torch.equal(layer(wide), _rows_alone(layer, wide))
    assert layer.quantized_bytes() < 256 * 96 * 1.1  # a byte a weight and the row scales


@needs_gemv
def test_int4_layers_keep_no_float16_copy_the_kernel_takes_every_width(weight_and_input):
    """The int4 kernel is faster than FBGEMM's fp16 GEMM at every batch width, so a wide batch's rows are those of
    the kernel too (each row's bits as when it is alone), and the layer holds only the 4-bit weight."""
    w, _ = weight_and_input
    layer = make_layer(WeightFormat("int4", 32), w, packed=False, gemv=True, wide_fp16=True)
    assert layer.wide is None and layer.interleaved is not None
    wide = torch.randn(layer.gemv.max_rows + 5, 256)
    assert torch.equal(layer(wide), _rows_alone(layer, wide))
    assert layer.quantized_bytes() < 256 * 96  # about half a byte a weight and its group scales


def _rows_alone(layer, x):
    return torch.cat([layer(row[None]) for row in x])


def _dequantized_bf16(fmt, w):
    """The weight a bf16 copy holds, as a plain tensor: w quantized to fmt, dequantized, rounded to bf16."""
    return fmt.convert(w).dequantize(torch.float32).to(torch.bfloat16)


def _layer(fmt, w, **settings):
    layer = QuantizedLinear(w.shape[1], w.shape[0], fmt, packed_kernels=False)
    for name, value in settings.items():
        setattr(layer, name, value)
    layer.load_weight(slice(0, None), w, "w")
    layer.finish_loading()
    return layer


@needs_gemv
@pytest.mark.parametrize("fmt", [INT8, WeightFormat("int4", 32)])
def test_an_amx_cpus_layer_takes_prefill_sized_calls_in_bf16_and_decode_through_its_kernel(weight_and_input, fmt):
    """wide_bf16 (CPUs with AMX, batch invariance off): from BF16_ROWS rows a bf16 copy of the dequantized weight in
    place of banyan's integer kernel (torch's bf16 GEMM runs on the tiles); fewer rows take the kernel as before.
    Batch-invariant layers, and layers banyan's kernel does not serve, keep no copy. The copy lies in oneDNN's
    blocked layout where torch has oneDNN, with the plain copy's bits."""
    w, _ = weight_and_input
    layer, reference = _layer(fmt, w, wide_bf16=True), make_layer(fmt, w, packed=False, gemv=True)
    wide, narrow = torch.randn(BF16_ROWS, 256), torch.randn(BF16_ROWS - 1, 256)
    assert layer.bf16.dtype == torch.bfloat16 and layer.quantized_bytes() >= 256 * 96 * 2
    assert layer.bf16.is_mkldnn == onednn_blocked(torch.zeros(16, 32, dtype=torch.bfloat16)).is_mkldnn
    plain = _dequantized_bf16(fmt, w)
    for rows in (BF16_ROWS, 3 * BF16_ROWS + 5):
        x = torch.randn(rows, 256)
        assert torch.equal(layer(x), F.linear(x.bfloat16(), plain).float())
    assert relative_error(layer(wide), F.linear(wide, w)) < 0.1
    assert torch.equal(layer(narrow), reference(narrow))
    assert _layer(fmt, w, wide_bf16=True, batch_invariant=True).bf16 is None
    assert _layer(fmt, w, wide_bf16=True, cpu_kernel=False).bf16 is None


def test_a_bf16_copy_stays_plain_where_onednn_refuses_to_block_it():
    """Where oneDNN has no bf16 path (an AVX2-only CPU; here its ISA capped to AVX2) the copy stays a plain tensor
    and F.linear takes it; on a CPU that blocks it, the blocked copy gives F.linear's bits."""
    script = ("import torch, torch.nn.functional as F\n"
              "from banyan.quantization.linear import bf16_linear, onednn_blocked\n"
              "w, x = torch.randn(96, 256).bfloat16(), torch.randn(130, 256).bfloat16()\n"
              "copy = onednn_blocked(w)\n"
              "assert torch.equal(bf16_linear(x, copy), F.linear(x, w))\n"
              "print(copy.is_mkldnn)\n")
    capped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert capped.stdout.split() == ["False"]
    w, x = torch.randn(96, 256).bfloat16(), torch.randn(130, 256).bfloat16()
    assert torch.equal(bf16_linear(x, onednn_blocked(w)), F.linear(x, w))


@needs_gemv
def test_a_gated_mlp_on_bf16_copies_keeps_its_middle_in_bf16():
    """Where gate_up and down both take a call on their bf16 copies (AMX prefill), the [rows, 2 x intermediate] and
    [rows, intermediate] between them stay bf16, which the bf16 GEMMs round them to anyway: the same numbers as the
    float32 round trip but the silu_mul product's one rounding; fewer rows, or a layer without a copy, as before."""
    from banyan.models.blocks import GatedMLP

    gen = torch.Generator().manual_seed(4)
    w_gate_up, w_down = torch.randn(2 * 64, 256, generator=gen) / 16, torch.randn(256, 64, generator=gen) / 8
    mlp = GatedMLP(256, 64)
    mlp.gate_up_proj, mlp.down_proj = _layer(INT8, w_gate_up, wide_bf16=True), _layer(INT8, w_down, wide_bf16=True)
    wide, narrow = torch.randn(BF16_ROWS, 256, generator=gen), torch.randn(BF16_ROWS - 1, 256, generator=gen)
    plain_gate_up, plain_down = _dequantized_bf16(INT8, w_gate_up), _dequantized_bf16(INT8, w_down)
    middle = F.linear(wide.bfloat16(), plain_gate_up)
    gate, up = middle.float().chunk(2, dim=-1)
    expected = F.linear((F.silu(gate) * up).bfloat16(), plain_down).float()
    out = mlp(wide)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, rtol=2e-2, atol=2e-3)
    round_trip = mlp.down_proj(mlp.act_mul(mlp.gate_up_proj(wide)))  # float32 between the two: the old path
    assert relative_error(out, round_trip) < 1e-2
    assert torch.equal(mlp(narrow), mlp.down_proj(mlp.act_mul(mlp.gate_up_proj(narrow))))
    mlp.down_proj = _layer(INT8, w_down)  # no copy: float32 between them
    assert torch.equal(mlp(wide), mlp.down_proj(mlp.act_mul(mlp.gate_up_proj(wide))))


@needs_gemv
@pytest.mark.parametrize("fmt", [INT8, WeightFormat("int4", 32), WeightFormat("fp16")])
@pytest.mark.parametrize("rows", [40, 41, 42])
def test_batch_invariant_layers_give_each_row_its_bits_alone(weight_and_input, fmt, rows):
    """batch_invariant: every row through banyan's kernel, 40 to 42 rows at once (where tiles are 4 rows, the last
    tile of 41 or 42 takes 5 or 6) bit for bit as one at a time (torch's GEMMs, FBGEMM's and MKL's, pick their
    blocking by the row count: their rows move in the last bits)."""
    w, _ = weight_and_input
    layer = QuantizedLinear(256, 96, fmt, packed_kernels=False)
    layer.batch_invariant = True
    layer.load_weight(slice(0, None), w, "w")
    layer.finish_loading()
    x = torch.randn(rows, 256)
    assert layer.gemv is not None and layer.wide is None
    assert torch.equal(layer(x), _rows_alone(layer, x))
    if fmt.kind == "fp16":  # float accumulation: close to the float32 matmul by the float16 weight
        torch.testing.assert_close(layer(x), F.linear(x, w.half().float()), rtol=1e-5, atol=1e-5)


@needs_gemv
def test_fixed_order_linear_is_the_float32_matmul_with_rows_independent(weight_and_input):
    w, _ = weight_and_input
    model = torch.nn.Sequential(torch.nn.Linear(256, 96))
    model[0].weight.data.copy_(w)
    use_fixed_order(model)
    x = torch.randn(40, 256)
    assert isinstance(model[0], FixedOrderLinear)
    assert torch.equal(model(x), _rows_alone(model, x))
    torch.testing.assert_close(model(x), F.linear(x, w, model[0].bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, blocker", [
    ({}, None),
    ({"device": torch.device("meta")}, "not a CPU"),
    ({"dtype": torch.bfloat16}, "torch.bfloat16 activations"),
    ({"attention": "triton"}, "the triton attention backend"),
    ({"lora": True}, "LoRA adapters"),
    ({"parallel": True}, "tensor or pipeline parallelism"),
    ({"plan": {"0": WeightFormat("fp16")}}, "fp16 or fp8 weights"),
    ({"model": torch.nn.Sequential(torch.nn.Linear(48, 8))}, "a layer's inputs are not in blocks of 32"),
    ({"amx": True}, "AMX tiles: prefill in bf16 through them is 1.7x the integer kernels'"),
])
def test_batch_invariance_is_on_by_default_only_where_its_cost_was_measured(change, blocker):
    """The default (batch_invariant=None) turns the mode on where it costs at most 10% (an x86 CPU with AVX2 or AVX-512,
    float32 model, float32/int8/int4 layers in blocks of 32, torch attention, no LoRA or parallelism); else it names
    why not."""
    args = dict(model=torch.nn.Sequential(torch.nn.Linear(64, 8)), device=torch.device("cpu"), dtype=torch.float32,
                plan={"0": WeightFormat("int4", 32)}, attention="torch", lora=False, parallel=False, amx=False) | change
    why = why_not_invariant_by_default(**args)
    if not cpu_gemv.vector_cpu() and args["device"].type == "cpu":
        assert why == "its cost is measured on x86 CPUs with AVX2 or AVX-512, not this one"
    elif blocker is None and cpu_gemv.load() is None:
        assert why == "banyan's CPU kernels are not built here"
    else:
        assert why == blocker


@needs_gemv
def test_fixed_order_attention_is_sdpa_with_each_row_alone():
    """banyan's fixed-order attention against SDPA (the torch backend's reference), and bit for bit the same for a
    row whatever shares the call: a decode row alone or beside longer sequences, a prompt whole or in chunks."""
    torch.manual_seed(0)
    k, v = torch.randn(3, 48, 2, 16), torch.randn(3, 48, 2, 16)  # [seqs, positions, kv_heads, head_dim]
    q = torch.randn(3, 48, 4, 16)
    causal = torch.ones(48, 48, dtype=torch.bool).tril()
    kernels = cpu_gemv.load()
    whole = kernels.attend(q, k, v, causal.expand(3, 48, 48), 0.25)  # every sequence's 48-token prompt at once
    reference = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.25,
                                               is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-5)
    for end in (1, 17, 48):  # a decode row at position end - 1, alone over its end positions
        alone = kernels.attend(q[:1, end - 1 : end], k[:1, :end], v[:1, :end], causal[None, end - 1 : end, :end], 0.25)
        assert torch.equal(alone[0, 0], whole[0, end - 1])
    chunk = kernels.attend(q[:1, 20:30], k[:1, :30], v[:1, :30], causal[None, 20:30, :30], 0.25)
    assert torch.equal(chunk[0], whole[0, 20:30])


def test_fp16_weights_through_fbgemm_equal_the_rounded_float32_matmul(weight_and_input):
    w, x = weight_and_input
    layer = make_layer(WeightFormat("fp16"), w)
    assert layer._matmul == layer._fp16_fbgemm and layer.weight is None  # the packed copy is the only one
    torch.testing.assert_close(layer(x), F.linear(x, w.half().float()), rtol=1e-5, atol=1e-5)


def test_int4_round_trip_keeps_values_on_the_grid():
    """A weight already on an int4 grid (as a dequantized Q4_1 one is) comes back exactly."""
    torch.manual_seed(1)
    grid = Int4Weight(torch.randint(0, 16, (16, 64), dtype=torch.uint8), torch.rand(16, 2) + 0.5, torch.randn(16, 2))
    grid.q[:, 0], grid.q[:, 32], grid.q[:, 1], grid.q[:, 33] = 0, 0, 15, 15  # each group spans the full range
    again = Int4Weight.quantize(grid.dequantize(), 32)
    torch.testing.assert_close(again.dequantize(), grid.dequantize())


def test_int8_per_channel_scale():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])
    q = Int8Weight.quantize(w)
    assert q.q[0].tolist() == [127, -64, 32] and q.q[1].tolist() == [0, 0, 0]
    assert torch.allclose(q.dequantize(), w, atol=1 / 127)


def test_a_ragged_int4_layer_falls_back_to_dequantizing():
    """torch's CPU int4 kernel tiles 16 output rows; 24 rows take the dequantizing path."""
    w, x = torch.randn(24, 64), torch.randn(3, 64)
    layer = make_layer(WeightFormat("int4", 32), w, packed=True)
    assert layer._matmul == layer._int4_dequant
    assert relative_error(layer(x), F.linear(x, w)) < 0.1


def test_plan_rejects_bad_settings():
    from banyan.config import ModelArch
    from banyan.layers.attention import get_attention_backend
    from banyan.models.llama import LlamaForCausalLM

    arch = ModelArch("LlamaForCausalLM", 64, 96, 128, 1, 4, 2, 24, tie_word_embeddings=True)
    model = LlamaForCausalLM(arch, get_attention_backend("torch"))
    with pytest.raises(InvalidParameterError, match="quantization"):
        plan_formats(model, "int3")
    with pytest.raises(InvalidParameterError, match="quantization_group_size"):
        plan_formats(model, "int4", group_size=64)  # 96 inputs
    with pytest.raises(InvalidParameterError, match="not a .gguf"):
        plan_formats(model, "gguf", file_formats=None)
    plan = plan_formats(model, "int4", group_size=32)
    assert plan["lm_head"] == INT8 and plan["model.layers.0.self_attn.qkv_proj"] == WeightFormat("int4", 32)
    assert "lm_head" not in plan_formats(model, "fp8")  # logits stay in the compute dtype
    quantize_linears(model, plan)
    assert model.model.embed_tokens.weight is model.lm_head.weight  # tied: one int8 copy serves both


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fp8 _scaled_mm needs sm89+)")
@pytest.mark.parametrize("fmt, tolerance", [(INT8, 0.01), (INT4_64, 0.12), (FP8, 0.06)])
def test_quantized_linear_on_cuda_in_bf16(fmt, tolerance):
    torch.manual_seed(0)
    w, x = torch.randn(256, 512, device="cuda") * 0.05, torch.randn(8, 512, device="cuda")
    with torch.device("cuda"):
        layer = make_layer(fmt, w.bfloat16())
    assert relative_error(layer(x.bfloat16()).float(), F.linear(x, w)) < tolerance


def test_the_cpu_default_keeps_what_the_checkpoint_holds_and_no_more():
    from banyan.quantization import Choice, default_method

    cpu, f32 = torch.device("cpu"), torch.float32
    assert default_method("none", cpu, f32, "bfloat16", False) == Choice(None)
    assert default_method("int8", cpu, f32, "float32", False) == Choice("int8")
    assert default_method(None, cpu, f32, "float32", False) == Choice(None)  # a float32 checkpoint stays float32
    assert default_method(None, cpu, torch.bfloat16, "bfloat16", False) == Choice(None)  # bf16 math: its own dtype
    assert default_method(None, cpu, f32, "bfloat16", False) == Choice("fp16")
    gguf = default_method(None, cpu, f32, None, True)
    kernel = cpu_gemv.load() is not None and cpu_gemv.vector_cpu()
    assert gguf == (Choice("gguf", mix_fp16=True) if kernel else Choice("fp16"))


def test_torch_packed_int_kernels_serve_only_where_banyans_kernel_is_not_built(monkeypatch):
    """On an AVX-512 CPU torch's packed int8/int4 kernels are vectorized, but banyan's (AVX-512 VNNI) was ~20x faster
    at batch 1 (docs/quantization.md, "CPUs with AVX-512"): torch's take the int layers only without banyan's."""
    cpu, avx512 = torch.device("cpu"), torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert packed_int_kernels_fast(cpu) == (avx512 and cpu_gemv.load() is None)
    monkeypatch.setattr(cpu_gemv, "load", lambda: None)  # no compiler
    assert packed_int_kernels_fast(cpu) == avx512
    assert not packed_int_kernels_fast(torch.device("meta"))


def test_without_a_compiler_the_cpu_kernel_is_not_built(monkeypatch, tmp_path):
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_gemv.load.__wrapped__() is None
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert cpu_gemv.load.__wrapped__() is None and not list(tmp_path.rglob("*.so"))


def test_auto_dtype_on_a_cpu_is_bf16_only_with_bf16_hardware_and_a_16_bit_checkpoint(monkeypatch):
    """GGUF files stay float32 even with AMX: their 4/8-bit tensors go through banyan's integer kernels."""
    from banyan.runner import device as model_runner
    from banyan.runner.device import resolve_dtype

    cpu = torch.device("cpu")
    for hardware in (False, True):
        monkeypatch.setattr(model_runner, "cpu_has_bf16_matmul", lambda hardware=hardware: hardware)
        want = torch.bfloat16 if hardware else torch.float32
        assert resolve_dtype("auto", "bfloat16", cpu) == want
        assert resolve_dtype("auto", None, cpu, is_gguf=True) == torch.float32
        assert resolve_dtype("auto", "bfloat16", cpu, is_gguf=True) == torch.float32
        assert resolve_dtype("auto", "float32", cpu) == torch.float32  # never rounds a float32 checkpoint
        assert resolve_dtype("auto", None, cpu) == torch.float32  # unknown: exact
        assert resolve_dtype("float32", "bfloat16", cpu) == torch.float32
