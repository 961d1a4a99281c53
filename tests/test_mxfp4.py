"""MXFP4 dequantization: against the OCP MX spec written out here, against transformers' own, a round trip, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from lenskit.io.mxfp4 import check_packed, check_quantization_config, dequantize_experts, dequantize_mxfp4, packed_pairs

DTYPES = (torch.float32, torch.bfloat16)


# ------------------------------------------------------------- the spec, by hand
def spec_element(code: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0, FP4 E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (m * 0.5)."""
    code = code.long()
    sign = 1.0 - 2.0 * ((code >> 3) & 1).double()
    exponent, mantissa = ((code >> 1) & 3).double(), (code & 1).double()
    normal = (1.0 + mantissa / 2) * torch.pow(2.0, exponent - 1)
    return sign * torch.where(exponent == 0, mantissa / 2, normal)


def spec_scale(scale: torch.Tensor) -> torch.Tensor:
    """E8M0: 2 ** (s - 127), in float64 (exact)."""
    return torch.tensor([math.ldexp(1.0, int(s) - 127) for s in scale.flatten()], dtype=torch.float64).view(scale.shape)


def spec_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., n_blocks * 32]; the packing (element 2i in the low nibble of byte i) is gpt-oss's convention."""
    elements = torch.stack([spec_element(blocks & 0x0F), spec_element(blocks >> 4)], dim=-1).flatten(-2)  # [..., n_blocks, 32]
    return (elements * spec_scale(scales)[..., None]).flatten(-2)


def random_pair(shape: tuple[int, ...], seed: int, scale_range=(100, 150)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(*scale_range, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def extreme_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Every e2m1 code at the smallest scales (float32 and bfloat16 subnormals) and every code that stays finite at
    the largest: 253 takes |x| <= 3, 254 |x| <= 1.5."""
    every_code = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte, so every pair of codes
    small = every_code[None].expand(4, 16, 16)  # [4 scales, 16 blocks, 16 bytes]
    codes_to_3 = torch.tensor([c for c in range(16) if abs(spec_element(torch.tensor(c)).item()) <= 3])
    codes_to_1_5 = torch.tensor([c for c in range(16) if abs(spec_element(torch.tensor(c)).item()) <= 1.5])

    def bytes_from(codes):
        g = torch.Generator().manual_seed(3)
        lo = codes[torch.randint(0, len(codes), (16, 16), generator=g)]
        hi = codes[torch.randint(0, len(codes), (16, 16), generator=g)]
        return (lo | (hi << 4)).to(torch.uint8)

    blocks = torch.cat([small, bytes_from(codes_to_3)[None], bytes_from(codes_to_1_5)[None]])  # [6, 16, 16]
    scales = torch.tensor([0, 1, 2, 252, 253, 254], dtype=torch.uint8)[:, None].expand(6, 16).contiguous()
    return blocks, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["random", "extreme", "every_scale"])
def test_equals_the_spec_exactly(case, dtype):
    if case == "random":
        blocks, scales = random_pair((3, 5, 4), seed=0)
    elif case == "extreme":
        blocks, scales = extreme_pair()
    else:  # every scale up to 252 (beyond it the larger values overflow), each with random codes
        blocks = torch.randint(0, 256, (253, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        scales = torch.arange(253, dtype=torch.uint8)
    want = spec_dequantize(blocks, scales)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.dtype == dtype and got.shape == (*blocks.shape[:-2], blocks.shape[-2] * 32)
    assert torch.equal(want.to(dtype).double(), want), "the spec's values are not all exact in this dtype"
    assert torch.equal(got.double(), want)
    if case != "random":
        assert (got != 0).any() and (got.abs().double() < 2.0 ** -126).any()  # subnormals were produced


def test_negative_zero_is_kept():
    blocks = torch.full((1, 16), 0x88, dtype=torch.uint8)  # code 8 twice: -0.0
    got = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert (got == 0).all() and torch.signbit(got).all()


# ------------------------------------------------------ transformers' own function
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_equal_transformers_dequantization(dtype):
    """transformers' `convert_moe_packed_tensors` is plain torch and runs on the CPU (no triton or kernels needed)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for shape, scale_range in (((4, 12, 2), (110, 140)), ((2, 64, 1), (0, 250))):  # [expert, out, n_blocks]
        blocks, scales = random_pair(shape, seed=2, scale_range=scale_range)
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize_experts(blocks, scales, dtype)
        assert got.shape == (shape[0], shape[2] * 32, shape[1]) and got.is_contiguous()  # [expert, in, out]
        assert torch.equal(got, want)


def test_expert_layout_is_the_dense_one_gpt_oss_reads():
    """`gate_up_proj_blocks` [expert, 2 * d_mlp, d_model / 32, 16] -> `gate_up_proj` [expert, d_model, 2 * d_mlp]:
    row r of the quantized tensor is output column r, and GptOssExperts reads gate = [..., ::2], up = [..., 1::2]."""
    blocks, scales = random_pair((2, 6, 1), seed=4)
    dense = dequantize_experts(blocks, scales, torch.float32)
    rows = dequantize_mxfp4(blocks, scales, torch.float32)  # [expert, out, in]
    assert torch.equal(dense[1, :, 3], rows[1, 3]) and torch.equal(dense[..., ::2], rows[:, ::2].transpose(1, 2))


# --------------------------------------------------------------- a round trip
def spec_quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX's rule: per block of 32, X = 2 ** (floor(log2(amax)) - 2) (2 = e2m1's largest exponent), elements
    value / X, which must be e2m1 values here. -> uint8 blocks [..., n_blocks, 16], scales [..., n_blocks]."""
    table = {spec_element(torch.tensor(c)).item(): c for c in range(16) if c != 8}  # +0.0 for zeros
    per_block = values.double().unflatten(-1, (-1, 32))  # [..., n_blocks, 32]
    amax = per_block.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -200))) - 2, torch.zeros_like(amax))
    scales = (exponent + 127).to(torch.uint8)
    scaled = per_block / torch.pow(2.0, exponent)[..., None]
    codes = torch.tensor([table[v] for v in scaled.flatten().tolist()], dtype=torch.uint8).view(scaled.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_of_representable_values(dtype):
    g = torch.Generator().manual_seed(5)
    elements = spec_element(torch.randint(0, 16, (3, 7, 4, 32), generator=g))  # [expert, rows, n_blocks, 32]
    exponents = torch.randint(-120, 120, (3, 7, 4, 1), generator=g).double()
    values = (elements * torch.pow(2.0, exponents)).flatten(-2).to(dtype)  # exactly representable by construction
    blocks, scales = spec_quantize(values)
    assert blocks.shape == (3, 7, 4, 16) and scales.shape == (3, 7, 4)
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), values)


# ------------------------------------------------------------------ refusals
def test_quantization_config():
    assert check_quantization_config({}) is False and check_quantization_config({"quantization_config": None}) is False
    gpt_oss = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    assert check_quantization_config({"quantization_config": gpt_oss}) is True
    for bad, words in (({"quant_method": "gptq", "bits": 4}, "'gptq'"), ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
                       ({"load_in_4bit": True}, "quant_method=None"), ("mxfp4", "must be an object")):
        with pytest.raises(ValueError, match="quantization_config") as info:
            check_quantization_config({"quantization_config": bad})
        assert words in str(info.value) and "\n" not in str(info.value)


def test_missing_partner_tensors_are_refused_by_name():
    name = "model.layers.0.mlp.experts.gate_up_proj"
    names = [f"{name}_blocks", f"{name}_scales", "model.layers.0.mlp.experts.down_proj_blocks", "lm_head.weight"]
    with pytest.raises(ValueError, match=r"down_proj_blocks but no model\.layers\.0\.mlp\.experts\.down_proj_scales"):
        packed_pairs(names)
    with pytest.raises(ValueError, match=r"down_proj_scales but no .*down_proj_blocks"):
        packed_pairs(["x.down_proj_scales"])
    assert packed_pairs(names[:2] + ["lm_head.weight"]) == {name: (f"{name}_blocks", f"{name}_scales")}
    blocks, _ = random_pair((2, 3, 1), seed=0)
    with pytest.raises(ValueError, match=f"{name}_blocks but no {name}_scales"):
        check_packed(name, blocks, None)


@pytest.mark.parametrize("change, words", [
    (dict(scales=torch.zeros(2, 3, dtype=torch.uint8)), r"x_scales has shape \[2, 3\], expected \[2, 3, 1\]"),
    (dict(scales=torch.zeros(2, 4, 1, dtype=torch.uint8)), r"x_scales has shape \[2, 4, 1\]"),
    (dict(scales=torch.zeros(2, 3, 1, dtype=torch.int32)), "x_scales has dtype torch.int32, expected torch.uint8"),
    (dict(blocks=torch.zeros(2, 3, 1, 16, dtype=torch.int8)), "x_blocks has dtype torch.int8"),
    (dict(blocks=torch.zeros(2, 3, 1, 8, dtype=torch.uint8)), r"x_blocks has shape \[2, 3, 1, 8\]"),
    (dict(dtype=torch.float16), "torch.float16"),
    (dict(scales=torch.full((2, 3, 1), 255, dtype=torch.uint8)), "x_scales holds the scale 255"),
    (dict(blocks=torch.full((2, 3, 1, 16), 0x77, dtype=torch.uint8), scales=torch.full((2, 3, 1), 253, dtype=torch.uint8)),
     "x: an MXFP4 block overflows"),
])
def test_bad_pairs_are_refused_in_one_line(change, words):
    args = {"blocks": torch.zeros(2, 3, 1, 16, dtype=torch.uint8), "scales": torch.zeros(2, 3, 1, dtype=torch.uint8),
            "dtype": torch.float32, **change}
    with pytest.raises(ValueError, match=words) as info:
        dequantize_mxfp4(args["blocks"], args["scales"], args["dtype"], name="x")
    assert "\n" not in str(info.value)


def test_experts_need_four_dims():
    with pytest.raises(ValueError, match=r"w_blocks has shape \[3, 1, 16\], expected \[expert, out, n_blocks, 16\]"):
        dequantize_experts(torch.zeros(3, 1, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8), name="w")


def test_large_tensors_are_dequantized_in_chunks(monkeypatch):
    import lenskit.io.mxfp4 as mxfp4

    blocks, scales = random_pair((5, 7), seed=6)
    whole = dequantize_mxfp4(blocks, scales, torch.float32)
    monkeypatch.setattr(mxfp4, "_CHUNK_ROWS", 4)  # 35 rows: 9 chunks, the last short
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), whole)
    assert torch.equal(whole.double(), spec_dequantize(blocks, scales))
