"""Mixture-of-experts configs and checkpoints that would compute something else are refused in one line naming the
field or tensor: too many experts per token, a misshapen router, a missing or misshapen expert tensor, and the
config fields lenskit does not implement (shared experts, OLMoE's clip_qkv, Qwen3-MoE's sliding window)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import make_hf_family
from safetensors.torch import load_file, save_file

from lenskit import HookedTransformer, ModelConfig


def refused(match: str, call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and re.search(match, message), message
    return message


def tiny_config(family: str, **changes) -> dict:
    return {**make_hf_family(family).config.to_dict(), **changes}


@pytest.mark.parametrize("family, key", [("mixtral", "num_local_experts"), ("qwen3_moe", "num_local_experts"),
                                         ("olmoe", "num_experts"), ("gpt_oss", "num_local_experts")])
def test_more_experts_per_token_than_experts(family, key):
    d = tiny_config(family, num_experts_per_tok=5)
    assert d[key] == 4  # the spelling transformers 5 writes
    refused(rf"config field num_experts_per_tok=5 exceeds {key}=4", ModelConfig.from_hf_config, d)
    # The hub's own spelling of the count (Qwen3-MoE's num_experts) reads the same, and is checked the same.
    hub = {k: v for k, v in d.items() if k not in ("num_local_experts", "num_experts")} | {"num_experts": 4}
    if family != "mixtral":
        refused(r"config field num_experts_per_tok=5 exceeds num_experts=4", ModelConfig.from_hf_config, hub)
    refused(r"ModelConfig.n_experts_per_token=5 exceeds n_experts=4",
            ModelConfig.from_hf_config(tiny_config(family)).replace, n_experts_per_token=5)


def test_the_two_spellings_of_the_expert_count_must_agree():
    d = tiny_config("qwen3_moe", num_experts=6)
    refused(r"config fields num_experts=6 and num_local_experts=4 disagree", ModelConfig.from_hf_config, d)


@pytest.mark.parametrize("family, field, value", [
    ("qwen3_moe", "shared_expert_intermediate_size", 64), ("olmoe", "n_shared_experts", 1),
    ("olmoe", "clip_qkv", 8.0), ("qwen3_moe", "use_sliding_window", True), ("qwen3_moe", "mlp_only_layers", [7]),
    ("mixtral", "num_local_experts", 0)])
def test_unimplemented_fields_are_refused_by_name(family, field, value):
    d = tiny_config(family, **{field: value})
    refused("config field " + re.escape(f"{field}={value!r}"), ModelConfig.from_hf_config, d)


def rewrite(folder, edit) -> None:
    """Rewrite folder/model.safetensors through `edit(tensors)`."""
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(params=["hub", "fused"])
def folder(request, tmp_path):
    """A tiny Mixtral folder: as transformers' save_pretrained writes it (the hub's per-expert names), or its
    in-memory fused 3-D tensors as they are."""
    hf = make_hf_family("mixtral", tie_word_embeddings=False)
    path = tmp_path / request.param
    if request.param == "hub":
        hf.save_pretrained(path)
    else:
        path.mkdir()
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    HookedTransformer.from_pretrained(path)  # loads as written
    return path


def test_a_misshapen_router_is_refused(folder):
    key = "model.layers.1.block_sparse_moe.gate.weight" if folder.name == "hub" else "model.layers.1.mlp.gate.weight"
    rewrite(folder, lambda t: t.__setitem__(key, t[key][:3].clone()))
    refused(r"tensor 'layers.1.block_sparse_moe.gate.weight' has shape \(3, 32\), but config.json implies \(4, 32\)",
            HookedTransformer.from_pretrained, folder)


def test_a_missing_expert_tensor_is_refused(folder):
    if folder.name == "hub":
        rewrite(folder, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
        refused(r"checkpoint is missing tensor\(s\) \['layers.1.block_sparse_moe.experts.3.w2.weight'\]",
                HookedTransformer.from_pretrained, folder)
    else:
        rewrite(folder, lambda t: t.pop("model.layers.1.mlp.experts.down_proj"))
        refused(r"checkpoint has 'layers.1.mlp.experts.gate_up_proj' but not 'layers.1.mlp.experts.down_proj'",
                HookedTransformer.from_pretrained, folder)


def test_a_misshapen_fused_expert_tensor_is_refused(folder):
    if folder.name == "hub":
        key = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
        rewrite(folder, lambda t: t.__setitem__(key, t[key][:-1].clone()))
        refused(r"tensor 'layers.0.block_sparse_moe.experts.2.w1.weight' has shape \(47, 32\), but config.json "
                r"implies \(48, 32\)", HookedTransformer.from_pretrained, folder)
    else:
        key = "model.layers.0.mlp.experts.gate_up_proj"
        rewrite(folder, lambda t: t.__setitem__(key, t[key][:3].clone()))
        refused(r"tensor 'layers.0.mlp.experts.gate_up_proj' has shape \(3, 96, 32\), but config.json implies "
                r"\(4, 96, 32\)", HookedTransformer.from_pretrained, folder)


def test_deepseek_v3s_published_fp8_checkpoint_is_refused_naming_fp8(tmp_path):
    """deepseek-ai/DeepSeek-V3's config.json as published, with its block-scaled fp8 weights: refused in one line
    naming the method, from the config alone and from a checkpoint folder."""
    from test_deepseek_v3 import PUBLISHED

    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    message = refused(r"quantization_config\.quant_method='fp8' is not supported.*unquantized",
                      ModelConfig.from_hf_config, {**PUBLISHED, "quantization_config": fp8})
    hf = make_hf_family("deepseek_v3")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": fp8}))
    assert refused("fp8", HookedTransformer.from_pretrained, tmp_path) == message
