"""MXFP4 (OCP Microscaling, FP4 e2m1 elements): gpt-oss's official checkpoints store their expert weights so.

A quantized tensor `W` is two tensors: `W_blocks`, uint8 [..., n_blocks, 16], each byte two 4-bit codes (the low
nibble is the earlier element), so a block is 32 elements; and `W_scales`, uint8 [..., n_blocks], one e8m0 exponent
per block, biased by 127. Element = FP4_E2M1[code] * 2 ** (scale - 127).

Every such product is exactly a float32 and a bfloat16 value (an e2m1 value has two significant bits, and bfloat16
has float32's exponent range, subnormals down to 2 ** -133 < 0.5 * 2 ** -127), so dequantizing to either is exact,
except where a product passes the dtype's largest finite value (scales 253 and 254) or the scale is 255, which the
format reserves for NaN; both are refused, naming the tensor. Weights are dequantized in chunks of rows, so the
working memory stays a few tens of MiB beside the result.

gpt-oss's dense expert layout is the transpose of the quantized rows: `gate_up_proj_blocks` [expert, 2 * d_mlp,
d_model / 32, 16] holds `gate_up_proj` [expert, d_model, 2 * d_mlp] (`dequantize_experts`). The loader reads an
MXFP4 checkpoint through `dequantize_checkpoint`: every pair is checked first, then each becomes its dense tensor.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

# code -> value; bit 3 is the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16  # 32 elements of 4 bits
SCALE_BIAS = 127
NAN_SCALE = 255
DTYPES = (torch.bfloat16, torch.float32)  # those every MXFP4 value (within range) is exactly
BLOCKS, SCALES = "_blocks", "_scales"
_CHUNK_ROWS = 1 << 18  # blocks per chunk: 4 MiB of codes, 32 MiB of float32 values
# 2 ** (s - 127) for every finite scale, exact in float64 and then in float32 (2 ** -127 is a float32 subnormal)
_POWERS = torch.tensor([2.0 ** (s - SCALE_BIAS) for s in range(NAN_SCALE)], dtype=torch.float64).float()


def check_quantization_config(config: Mapping[str, Any]) -> bool:
    """Whether `config.json` (a dict) declares MXFP4 quantization: False without a `quantization_config` (or null),
    True for `quant_method: "mxfp4"`; any other method is refused by name. MXFP4 checkpoints carry `*_blocks` and
    `*_scales` pairs for what is quantized (gpt-oss: the experts) and plain tensors for the rest."""
    q = config.get("quantization_config")
    if q is None:
        return False
    if not isinstance(q, Mapping):
        raise ValueError(f"config field quantization_config={q!r} must be an object; lenskit reads only "
                         "quant_method='mxfp4' (dequantized on load) or no quantization")
    method = q.get("quant_method")
    if method != "mxfp4":
        raise ValueError(f"config field quantization_config.quant_method={method!r} is not supported; lenskit dequantizes "
                         "only 'mxfp4' on load: use an unquantized (bf16 or fp32) copy of the checkpoint")
    return True


QUANTIZED_FAMILIES = ("gpt_oss",)  # the model types whose published checkpoints are MXFP4


def check_family_quantization(config: Mapping[str, Any], model_type: str) -> None:
    """Refuse, by name, a `quantization_config` that lenskit cannot read for `model_type`: another method in any
    family, and MXFP4 outside the families published so."""
    if check_quantization_config(config) and model_type not in QUANTIZED_FAMILIES:
        raise ValueError(f"config field quantization_config.quant_method='mxfp4' is supported only for model_type in "
                         f"{list(QUANTIZED_FAMILIES)}, not {model_type!r}; use the unquantized checkpoint")


def dequantize_checkpoint(raw: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with each `W_blocks` / `W_scales` pair replaced by `W`, dequantized exactly to `dtype`
    (bfloat16 or float32; float32 for another dtype, which the loader then converts to). Every pair's shapes and
    dtypes are checked before any is dequantized; a dense `W` beside its pair is refused as ambiguous."""
    pairs = packed_pairs(raw)
    for dense, (blocks, scales) in pairs.items():
        check_packed(dense, raw[blocks], raw[scales])
        if dense in raw:
            raise ValueError(f"checkpoint has {dense} and its MXFP4 pair {blocks}, {scales}; keep one of them")
    out = {k: v for k, v in raw.items() if not k.endswith((BLOCKS, SCALES))}
    to = dtype if dtype in DTYPES else torch.float32
    for dense, (blocks, scales) in pairs.items():
        out[dense] = dequantize_experts(raw[blocks], raw[scales], to, name=dense)
    return out


def packed_pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Dense tensor name -> (its `_blocks` name, its `_scales` name), for every pair among a checkpoint's `names`;
    a `_blocks` tensor without its `_scales`, or the reverse, is refused by name."""
    names = set(names)
    pairs = {}
    for name in sorted(names):
        for have, want in ((BLOCKS, SCALES), (SCALES, BLOCKS)):
            if name.endswith(have):
                dense = name[: -len(have)]
                if dense + want not in names:
                    raise ValueError(f"checkpoint has {name} but no {dense + want}: an MXFP4 tensor needs both; "
                                     "the checkpoint is incomplete, download it again")
                pairs[dense] = (dense + BLOCKS, dense + SCALES)
    return pairs


def check_packed(name: str, blocks: Any, scales: Any | None) -> None:
    """Refuse, naming the tensor, an MXFP4 pair that cannot be dequantized: a missing scale tensor (None), either one
    not uint8, blocks not [..., n_blocks, 16], or scales not [..., n_blocks] with blocks' leading dims. `blocks` and
    `scales` need only `.shape` and `.dtype` (tensors, or a file's metadata)."""
    if scales is None:
        raise ValueError(f"checkpoint has {name}{BLOCKS} but no {name}{SCALES}: an MXFP4 tensor needs both; "
                         "the checkpoint is incomplete, download it again")
    for suffix, t in ((BLOCKS, blocks), (SCALES, scales)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}{suffix} has dtype {t.dtype}, expected torch.uint8 (MXFP4 codes and exponents); "
                             "the file is not an MXFP4 checkpoint")
    shape, scale_shape = tuple(blocks.shape), tuple(scales.shape)
    if len(shape) < 2 or shape[-1] != BLOCK_BYTES:
        raise ValueError(f"{name}{BLOCKS} has shape {list(shape)}, expected [..., n_blocks, {BLOCK_BYTES}] (32 FP4 values "
                         "per block); the file is not an MXFP4 checkpoint")
    if scale_shape != shape[:-1]:
        raise ValueError(f"{name}{SCALES} has shape {list(scale_shape)}, expected {list(shape[:-1])} (one exponent per "
                         f"block of {name}{BLOCKS} {list(shape)}); the checkpoint is inconsistent, download it again")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     name: str = "an MXFP4 tensor") -> torch.Tensor:
    """blocks uint8 [..., n_blocks, 16], scales uint8 [..., n_blocks] -> [..., n_blocks * 32] in `dtype`
    (bfloat16 or float32), exactly; `name` (the tensor's, without `_blocks`) goes into the errors.

    >>> codes = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)  # low nibble 1 (0.5) first, then 2 (1.0)
    >>> dequantize_mxfp4(codes, torch.tensor([128], dtype=torch.uint8), torch.float32)[:3].tolist()  # times 2 ** 1
    [1.0, 2.0, 0.0]
    """
    check_packed(name, blocks, scales)
    if dtype not in DTYPES:
        raise ValueError(f"MXFP4 dequantization of {name} to {dtype}: expected one of {list(DTYPES)}, whose values hold "
                         "every MXFP4 value exactly")
    *lead, n_blocks, _ = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK_BYTES), scales.reshape(-1)  # [rows, 16], [rows]
    table, powers = torch.tensor(FP4_E2M1, device=blocks.device), _POWERS.to(blocks.device)
    out = torch.empty(flat_blocks.shape[0], 2 * BLOCK_BYTES, dtype=dtype, device=blocks.device)  # [rows, 32]
    for start in range(0, flat_blocks.shape[0], _CHUNK_ROWS):
        codes, exps = flat_blocks[start:start + _CHUNK_ROWS], flat_scales[start:start + _CHUNK_ROWS].long()
        if (exps == NAN_SCALE).any():
            raise ValueError(f"{name}{SCALES} holds the scale {NAN_SCALE}, which MXFP4 reserves for NaN; a trained "
                             "checkpoint has none: the file is corrupt, download it again")
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(1)  # [rows, 32], low nibble first
        values = table[nibbles.long()] * powers[exps][:, None]  # float32, exact or inf
        if not torch.isfinite(values).all():
            raise ValueError(f"{name}: an MXFP4 block overflows float32 (a scale >= 253 with a large value); no trained "
                             "checkpoint holds one: the file is corrupt, download it again")
        out[start:start + _CHUNK_ROWS] = values  # to bfloat16 without rounding: two significant bits
    return out.view(*lead, n_blocks * 2 * BLOCK_BYTES)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                       name: str = "an MXFP4 expert tensor") -> torch.Tensor:
    """gpt-oss's quantized experts [expert, out, n_blocks, 16] (+ scales) -> the dense layout [expert, in, out] that
    transformers 5 reads and writes (`mlp.experts.gate_up_proj` [expert, d_model, 2 * d_mlp], gate and up
    interleaved along the last axis; `down_proj` [expert, d_mlp, d_model])."""
    if blocks.dim() != 4:
        raise ValueError(f"{name}{BLOCKS} has shape {list(blocks.shape)}, expected [expert, out, n_blocks, "
                         f"{BLOCK_BYTES}]; the file is not a gpt-oss MXFP4 checkpoint")
    return dequantize_mxfp4(blocks, scales, dtype, name=name).transpose(1, 2).contiguous()  # [expert, in, out]
