"""gpt-oss (model_type gpt_oss) against transformers' GptOssForCausalLM: its router and experts through the MoE hooks
(mlp_out = Σ_k weight_k · expert_out_k), attention sinks (pattern + sink = 1), its alternating sliding and full blocks,
the clamp of its SwiGLU, its weight views, an MXFP4 checkpoint written here from the format's spec, and the refusals
of a broken MXFP4 pair or another quantization method, through `from_pretrained`.

Golden parity of the whole stream (tied and untied, padded batches, save_pretrained both ways, bf16 files) runs for
gpt_oss in test_families.py, through the registry; its presets' parameter counts in test_moe_accounting.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_hf_family
from golden import assert_golden, hf_blocks, hf_module_outputs, max_diff
from safetensors.torch import load_file, save_file

from lenskit import HookedTransformer
from lenskit.families.gpt_oss import split_gate_up
from lenskit.pieces.attention import SlidingWindowMask

EVERY_HOOK = lambda name: True  # noqa: E731 - includes the on-request hook_expert_out


@pytest.fixture(scope="module")
def pair():
    hf = make_hf_family("gpt_oss", seed=2)
    return hf, HookedTransformer.from_hf(hf)


def test_the_pieces_read_from_the_config(pair):
    _, model = pair
    fields = dict(attn_sinks=True, layer_types=("sliding", "full"), sliding_window=5, rope_type="yarn", rope_factor=4.0,
                  rope_original_n_ctx=16, rope_truncate=False, qkv_bias=True, out_bias=True, router_bias=True,
                  routing="topk_softmax", mlp="swiglu_clamped", swiglu_alpha=1.5, swiglu_limit=1.5, n_experts=4,
                  n_experts_per_token=2, d_head=16, n_kv_heads=2, norm_eps=1e-5)
    assert {k: getattr(model.cfg, k) for k in fields} == fields


# ------------------------------------------------------------------------------------- router and experts
def test_router_hooks_are_transformers_routing(pair, tokens):
    hf, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    batch, pos = tokens.shape
    for i, (logits, weights, indices) in hf_module_outputs(hf, tokens, "mlp.router").items():
        assert cache[f"blocks.{i}.mlp.hook_router_logits"].shape == (batch, pos, 4)
        assert max_diff(cache[f"blocks.{i}.mlp.hook_router_logits"].flatten(0, 1), logits) <= 1e-5
        assert torch.equal(cache[f"blocks.{i}.mlp.hook_expert_indices"].flatten(0, 1), indices)
        ours = cache[f"blocks.{i}.mlp.hook_expert_weights"]
        assert max_diff(ours.flatten(0, 1), weights) <= 1e-6
        torch.testing.assert_close(ours.sum(-1), torch.ones(batch, pos), atol=1e-6, rtol=0)  # a softmax over the k
    bias = model.blocks[0].mlp.router.bias
    assert bias is not None and torch.equal(bias, hf_blocks(hf)[0].mlp.router.bias) and bias.abs().max() > 1e-2


def test_mlp_out_is_the_weighted_sum_of_transformers_experts(pair, tokens):
    hf, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    for i in range(model.cfg.n_layers):
        weights, out = cache[f"blocks.{i}.mlp.hook_expert_weights"], cache[f"blocks.{i}.mlp.hook_expert_out"]
        torch.testing.assert_close(cache["mlp_out", i], torch.einsum("bpk,bpkm->bpm", weights, out), atol=1e-6, rtol=0)
        # every slot's output is transformers' expert, run from its own fused tensors and activation
        experts = hf_blocks(hf)[i].mlp.experts
        x, chosen = cache[f"blocks.{i}.ln2.hook_normalized"], cache[f"blocks.{i}.mlp.hook_expert_indices"]
        e = chosen.flatten()  # [token * k]
        flat = x.flatten(0, 1).repeat_interleave(model.cfg.moe.n_experts_per_token, 0)  # [token * k, d_model]
        with torch.no_grad():
            gate_up = torch.einsum("td,tdm->tm", flat, experts.gate_up_proj[e]) + experts.gate_up_proj_bias[e]
            want = torch.einsum("tm,tmd->td", experts._apply_gate(gate_up), experts.down_proj[e]) + experts.down_proj_bias[e]
        torch.testing.assert_close(out.flatten(0, 2), want, atol=1e-5, rtol=1e-5)


def test_the_clamp_bites_and_matches(tokens):
    """The tiny model's gate and up projections pass swiglu_limit often; without the clamp (a limit no value
    reaches) the model computes something else, and both match transformers."""
    clamped, loose = make_hf_family("gpt_oss"), make_hf_family("gpt_oss", swiglu_limit=1e4)
    seen = []
    experts = hf_blocks(clamped)[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        clamped(tokens)
    handle.remove()
    gate, up = split_gate_up(seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0])
    limit = clamped.config.swiglu_limit
    assert (gate > limit).float().mean() > 0.05 and (up.abs() > limit).float().mean() > 0.05
    with torch.no_grad():
        assert max_diff(clamped(tokens).logits, loose(tokens).logits) > 1e-2
    for hf in (clamped, loose):
        assert_golden(HookedTransformer.from_hf(hf), hf, tokens)


def test_expert_weight_views_are_transformers_fused_tensors(pair):
    hf, model = pair
    for i in range(model.cfg.n_layers):
        experts, mlp = hf_blocks(hf)[i].mlp.experts, model.blocks[i].mlp
        gate, up = split_gate_up(experts.gate_up_proj)  # [expert, d_model, d_expert] each
        gate_b, up_b = split_gate_up(experts.gate_up_proj_bias)
        assert torch.equal(mlp.W_gate, gate) and torch.equal(mlp.W_in, up) and torch.equal(mlp.W_out, experts.down_proj)
        assert torch.equal(mlp.b_gate, gate_b) and torch.equal(mlp.b_in, up_b) and torch.equal(mlp.b_out, experts.down_proj_bias)
        assert torch.equal(mlp.W_router, hf_blocks(hf)[i].mlp.router.weight.T)
        assert torch.equal(mlp.b_router, hf_blocks(hf)[i].mlp.router.bias)
        assert mlp.b_out.abs().max() > 1e-2  # biases, away from zero (conftest), are read, not dropped


# ------------------------------------------------------------------------------------- attention
def test_sinks_take_their_share_and_pattern_plus_sink_is_one(pair, tokens):
    hf, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    with torch.no_grad():
        theirs = hf(tokens, output_attentions=True).attentions  # transformers' probabilities over the real keys
    for i in range(model.cfg.n_layers):
        pattern, sink = cache[f"blocks.{i}.attn.hook_pattern"], cache[f"blocks.{i}.attn.hook_sink"]
        assert sink.shape == (*tokens.shape[:1], model.cfg.n_heads, tokens.shape[1])
        torch.testing.assert_close(pattern.sum(-1) + sink, torch.ones_like(sink), atol=1e-6, rtol=0)
        assert max_diff(pattern, theirs[i]) <= 1e-5
        assert sink.max() > 0.5 and sink.min() < 0.05  # the sinks are far from zero: some heads give most to it
        assert torch.equal(model.blocks[i].attn.sinks, hf_blocks(hf)[i].self_attn.sinks)


def test_blocks_alternate_sliding_and_full_and_the_window_bites(tokens):
    model = HookedTransformer.from_hf(make_hf_family("gpt_oss"))
    assert isinstance(model.blocks[0].attn.mask, SlidingWindowMask) and model.blocks[0].attn.mask.window == 5
    assert not isinstance(model.blocks[1].attn.mask, SlidingWindowMask)
    wide_hf = make_hf_family("gpt_oss", sliding_window=64)
    wide = HookedTransformer.from_hf(wide_hf)
    assert_golden(wide, wide_hf, tokens)
    with torch.no_grad():
        a, b = model(tokens), wide(tokens)
    assert max_diff(a[:, :5], b[:, :5]) <= 1e-5 and max_diff(a[:, 5:], b[:, 5:]) > 1e-3


def test_yarn_changes_the_model_and_matches(tokens):
    plain_hf = make_hf_family("gpt_oss", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    plain, yarn = HookedTransformer.from_hf(plain_hf), HookedTransformer.from_hf(make_hf_family("gpt_oss"))
    assert plain.cfg.rope.type == "default" and yarn.cfg.rope.type == "yarn"
    assert_golden(plain, plain_hf, tokens)
    with torch.no_grad():
        assert max_diff(plain(tokens), yarn(tokens)) > 1e-3


# ------------------------------------------------------------------------------------- MXFP4 checkpoints
def spec_value(code: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 from the OCP spec's formula, not a table: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal, 0.5 * mantissa."""
    sign = 1 - 2 * ((code >> 3) & 1).double()
    exp, man = ((code >> 1) & 3).double(), (code & 1).double()
    return sign * torch.where(exp == 0, 0.5 * man, 2 ** (exp - 1) * (1 + man / 2))


def quantize_exactly(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and scales for a quantized tensor of rows `shape` = [expert, out, in]: (blocks uint8
    [expert, out, in / 32, 16], scales uint8 [expert, out, in / 32], the dense values [expert, in, out] float64,
    in gpt-oss's dense layout), every dense value exactly an FP4 value times its block's power of two."""
    *lead, n = shape
    codes = torch.randint(0, 16, (*lead, n // 32, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(123, 127, (*lead, n // 32), generator=gen, dtype=torch.uint8)  # x 2**-4 .. 2**-1
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # two codes a byte, the earlier in the low nibble
    dense = spec_value(codes) * 2.0 ** (scales.double() - 127)[..., None]  # [expert, out, in / 32, 32]
    return blocks, scales, dense.reshape(*lead, n).transpose(1, 2)


def write_mxfp4(hf, folder, gen: torch.Generator) -> None:
    """`hf` with its expert weights replaced by exactly representable MXFP4 values, saved by transformers and
    rewritten as an MXFP4 checkpoint: `*_blocks` / `*_scales` for the expert weights and a quantization_config."""
    packed = {}
    with torch.no_grad():
        for i, block in enumerate(hf_blocks(hf)):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(block.mlp.experts, name)  # [expert, in, out]
                blocks, scales, dense = quantize_exactly((param.shape[0], param.shape[2], param.shape[1]), gen)
                param.copy_(dense.float())
                key = f"model.layers.{i}.mlp.experts.{name}"
                packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
    hf.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k + "_blocks" not in packed} | packed
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    # MXFP4 quantizes each row in blocks of 32: both d_model and the experts' width must be multiples of 32
    hf = make_hf_family("gpt_oss", tie_word_embeddings=False, seed=8, intermediate_size=64)
    folder = tmp_path_factory.mktemp("mxfp4")
    write_mxfp4(hf, folder, torch.Generator().manual_seed(0))
    return hf, folder


def test_an_mxfp4_checkpoint_loads_dequantized_exactly(mxfp4_pair, tokens):
    hf, folder = mxfp4_pair
    assert any(k.endswith("gate_up_proj_blocks") for k in load_file(str(folder / "model.safetensors")))
    model = HookedTransformer.from_pretrained(folder)
    experts = hf_blocks(hf)[1].mlp.experts
    assert torch.equal(model.blocks[1].mlp.W_gate, split_gate_up(experts.gate_up_proj)[0])  # exactly the values
    assert torch.equal(model.blocks[1].mlp.W_out, experts.down_proj)
    assert_golden(model, hf, tokens)


def test_an_mxfp4_checkpoint_loads_in_bf16_exactly(mxfp4_pair):
    hf, folder = mxfp4_pair
    model = HookedTransformer.from_pretrained(folder, dtype="bfloat16")
    w = model.blocks[0].mlp.W_in
    assert w.dtype == torch.bfloat16 and torch.equal(w.float(), split_gate_up(hf_blocks(hf)[0].mlp.experts.gate_up_proj)[1])


def test_our_dequantization_is_transformers_own(mxfp4_pair):
    """transformers' `convert_moe_packed_tensors` (plain torch, runs on the CPU) reads the same file to the same tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, folder = mxfp4_pair
    tensors = load_file(str(folder / "model.safetensors"))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    theirs = convert_moe_packed_tensors(tensors[key + "_blocks"], tensors[key + "_scales"], dtype=torch.float32)
    assert torch.equal(theirs, hf_blocks(hf)[0].mlp.experts.gate_up_proj)


def broken_copy(folder, tmp_path, edit_tensors=None, edit_config=None):
    out = tmp_path / "broken"
    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


KEY = "model.layers.1.mlp.experts.down_proj"


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.pop(KEY + "_scales"), (KEY + "_blocks", "no " + KEY + "_scales")),
    (lambda t: t.__setitem__(KEY + "_scales", t[KEY + "_scales"][:, :, :-1].contiguous()), (KEY + "_scales", "expected")),
    (lambda t: t.__setitem__(KEY + "_scales", t[KEY + "_scales"].float()), (KEY + "_scales", "torch.uint8")),
    (lambda t: t.pop(KEY + "_blocks"), (KEY + "_scales", "no " + KEY + "_blocks")),
], ids=["scales-missing", "scales-misshaped", "scales-not-uint8", "blocks-missing"])
def test_a_broken_mxfp4_pair_is_refused_by_name(mxfp4_pair, tmp_path, edit, words):
    _, folder = mxfp4_pair
    with pytest.raises(ValueError) as err:
        HookedTransformer.from_pretrained(broken_copy(folder, tmp_path, edit_tensors=edit))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_missing_expert_tensor_is_refused_by_name(mxfp4_pair, tmp_path):
    _, folder = mxfp4_pair

    def drop(t):
        t.pop(KEY + "_blocks"), t.pop(KEY + "_scales")

    with pytest.raises(ValueError, match=r"checkpoint has 'layers\.1\.mlp\.experts\.gate_up_proj' but not "
                                         r"'layers\.1\.mlp\.experts\.down_proj'"):
        HookedTransformer.from_pretrained(broken_copy(folder, tmp_path, edit_tensors=drop))


@pytest.mark.parametrize("family, quantization, words", [
    ("gpt_oss", {"quant_method": "bitsandbytes", "load_in_4bit": True}, ("quantization_config.quant_method='bitsandbytes'",)),
    ("gpt_oss", {"quant_method": "fp8"}, ("quant_method='fp8'", "not supported")),
    ("llama", {"quant_method": "mxfp4"}, ("quant_method='mxfp4'", "gpt_oss", "'llama'")),
    ("mixtral", {"quant_method": "awq", "bits": 4}, ("quant_method='awq'",)),
])
def test_another_quantization_config_is_refused_by_name(family, quantization, words, tmp_path):
    folder = tmp_path / family
    make_hf_family(family).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError) as err:
        HookedTransformer.from_pretrained(folder)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_without_a_quantization_config_packed_tensors_are_refused(mxfp4_pair, tmp_path):
    _, folder = mxfp4_pair
    plain = broken_copy(folder, tmp_path, edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"_proj_blocks' has dtype torch\.uint8"):
        HookedTransformer.from_pretrained(plain)


@pytest.mark.parametrize("key, edit, words", [
    ("model.layers.1.mlp.router.weight", lambda t: t[:3], ("'layers.1.mlp.router.weight' has shape (3, 32)", "(4, 32)")),
    ("model.layers.0.mlp.router.bias", lambda t: t[:3], ("'layers.0.mlp.router.bias' has shape (3,)", "(4,)")),
    ("model.layers.0.mlp.experts.down_proj_bias", lambda t: t[:, :-1], ("'layers.0.mlp.experts.down_proj_bias' has shape "
                                                                        "(4, 31)", "(4, 32)")),
    ("model.layers.1.mlp.experts.gate_up_proj", lambda t: t.transpose(1, 2), ("'layers.1.mlp.experts.gate_up_proj' has "
                                                                             "shape (4, 96, 32)", "(4, 32, 96)")),
    ("model.layers.1.mlp.experts.gate_up_proj_bias", None, ("has 'layers.1.mlp.experts.gate_up_proj' but not "
                                                            "'layers.1.mlp.experts.gate_up_proj_bias'",)),
    ("model.layers.0.self_attn.sinks", None, ("missing", "'layers.0.self_attn.sinks'")),
], ids=["router", "router-bias", "down-bias", "gate-up-transposed", "gate-up-bias-missing", "sinks-missing"])
def test_a_broken_dense_checkpoint_is_refused_by_name(tmp_path, key, edit, words):
    folder = tmp_path / "saved"
    make_hf_family("gpt_oss", tie_word_embeddings=False).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    if edit is None:
        tensors.pop(key)
    else:
        tensors[key] = edit(tensors[key]).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        HookedTransformer.from_pretrained(folder)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_dense_checkpoint_loads_memory_mapped_and_saves_fused(tmp_path, tokens):
    """transformers' fused expert tensors load as views of the mapped file; lenskit saves them fused again, as
    transformers wrote them, name for name and value for value."""
    hf = make_hf_family("gpt_oss", tie_word_embeddings=False, seed=9)
    hf.save_pretrained(tmp_path / "hf")
    model = HookedTransformer.from_pretrained(tmp_path / "hf")
    assert model.weight_files is not None
    assert not model.blocks[0].mlp.experts[1].gate.weight.untyped_storage().resizable()  # the file's pages
    model.save_pretrained(tmp_path / "ours")
    theirs, ours = (load_file(str(tmp_path / f / "model.safetensors")) for f in ("hf", "ours"))
    assert sorted(theirs) == sorted(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
