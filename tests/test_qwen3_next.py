"""Qwen3-Next's own reading (golden parity, saving, the preset's counts and every test above the model run through the
registry: test_families.py, test_families_saving.py, test_accounting.py): the published config.json reads as the
preset; the fused DeltaNet projections split as transformers splits them; the gated shared expert against transformers'
own block, its hooks, ablation and count; the multi-token-prediction weights are left unread; settings transformers
does not run (or that lenskit does not) are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import make_hf_family
from safetensors.torch import load_file, save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet, Qwen3NextSparseMoeBlock

from lenskit import HookedTransformer, ModelConfig
from lenskit.families import FAMILIES
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.pieces.deltanet import GatedDeltaNet, fused_to_ours, ours_to_fused
from lenskit.pieces.shared_experts import SharedExpertsMoE

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (as published, transformers 4 spelling)
PUBLISHED = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_the_published_config_reads_as_the_preset():
    read = ModelConfig.from_hf_config(PUBLISHED)
    preset = ModelConfig.from_name("qwen3-next-80b-a3b")
    assert dataclasses.replace(read, name=preset.name) == preset
    assert read.layer_types[:4] == ("linear", "linear", "linear", "full") and read.rope.dim == 64
    assert (read.moe.d_shared, read.moe.shared_gate, read.linear.fused, read.moe.dense_layers) == (512, True, True, ())


@pytest.mark.parametrize("change, words", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "linear"),
    ({"linear_num_value_heads": 24}, "linear_num_value_heads=24"),
    ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 513}, "num_experts_per_tok=513"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**PUBLISHED, **change})
    assert "\n" not in str(e.value)


def test_sparse_step_and_dense_blocks_and_no_experts_read_as_transformers_builds():
    read = ModelConfig.from_hf_config({**PUBLISHED, "decoder_sparse_step": 2, "mlp_only_layers": [1, 4]})
    assert read.moe.dense_layers == tuple(i for i in range(48) if i % 2 == 0 or i in (1, 4))
    dense = ModelConfig.from_hf_config({**PUBLISHED, "num_experts": 0})
    assert dense.moe.n_experts is None and dense.moe.n_shared_experts == 0


def _deltanet_pair(seed: int = 0):
    """transformers' Gated DeltaNet of the tiny config and ours with its weights, loaded through the family's layout."""
    torch.manual_seed(seed)
    hf_cfg = Qwen3NextConfig(**FAMILIES["qwen3_next"].tiny)
    theirs = Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=1).eval()
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    ours = GatedDeltaNet(cfg).eval()
    layout = FAMILIES["qwen3_next"].layout
    names = {ours_name: theirs_name.removeprefix("linear_attn.") for ours_name, theirs_name in layout.block.items()
             if ours_name.startswith("attn.") and theirs_name.startswith("linear_attn.")}
    ours.load_state_dict({local: layout.to_ours(f"blocks.1.attn.{local}", theirs.state_dict()[names[f"attn.{local}"]], cfg)
                          for local in ours.state_dict()})
    return theirs, ours, cfg


def test_the_fused_projections_split_as_transformers_splits_them():
    theirs, ours, cfg = _deltanet_pair()
    x = torch.randn(2, 5, cfg.d_model)
    with torch.no_grad():
        q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x), theirs.in_proj_ba(x))
        mixed, z_ours, b_ours, a_ours = ours.projections(x)
    want = torch.cat([t.reshape(2, 5, -1) for t in (q, k, v)], dim=-1)
    assert torch.equal(mixed, want) and torch.equal(z_ours, z.reshape(2, 5, -1))
    assert torch.equal(b_ours, b) and torch.equal(a_ours, a)
    with torch.no_grad():  # and the layer's whole write
        assert (ours(x) - theirs(x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("which", ["qkvz", "ba"])
def test_the_stored_order_comes_back(which):
    cfg = ModelConfig.from_name("qwen3-next-80b-a3b")  # the real head counts; 4 columns stand for d_model
    lin = cfg.linear
    rows = 2 * lin.n_k_heads * lin.d_k + 2 * lin.n_v_heads * lin.d_v if which == "qkvz" else 2 * lin.n_v_heads
    stored = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4)
    ours = fused_to_ours(stored, cfg, which)
    assert not torch.equal(ours, stored)  # a real permutation of the rows
    assert torch.equal(ours_to_fused(ours, cfg, which), stored)


def _moe_pair(norm_topk: bool):
    torch.manual_seed(1)
    hf_cfg = Qwen3NextConfig(**{**FAMILIES["qwen3_next"].tiny, "norm_topk_prob": norm_topk})
    theirs = Qwen3NextSparseMoeBlock(hf_cfg).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    ours = SharedExpertsMoE(cfg).eval()
    m = cfg.moe.d_expert
    state = {"router.weight": theirs.gate.weight, "shared_gate.weight": theirs.shared_expert_gate.weight,
             "shared.gate.weight": theirs.shared_expert.gate_proj.weight,
             "shared.fc_in.weight": theirs.shared_expert.up_proj.weight,
             "shared.fc_out.weight": theirs.shared_expert.down_proj.weight}
    for e in range(cfg.moe.n_experts):
        state |= {f"experts.{e}.gate.weight": theirs.experts.gate_up_proj[e, :m],
                  f"experts.{e}.fc_in.weight": theirs.experts.gate_up_proj[e, m:],
                  f"experts.{e}.fc_out.weight": theirs.experts.down_proj[e]}
    ours.load_state_dict(state)
    return theirs, ours, cfg


@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_gated_shared_expert_block_is_transformers(norm_topk):
    theirs, ours, cfg = _moe_pair(norm_topk)
    x = torch.randn(2, 7, cfg.d_model)
    seen = {}
    ours.hook_shared_gate.add_hook(lambda t, hook: seen.setdefault("gate", t))
    ours.hook_shared_out.add_hook(lambda t, hook: seen.setdefault("shared", t))
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max().item() < 1e-5
        gate = torch.sigmoid(theirs.shared_expert_gate(x))
        assert torch.allclose(seen["gate"], gate, atol=1e-6)
        assert torch.allclose(seen["shared"], gate * theirs.shared_expert(x), atol=1e-6)
    assert "e_score_correction_bias" not in dict(ours.named_buffers())  # DeepSeek's, not Qwen3-Next's


def test_counts_include_the_shared_expert_and_its_gate():
    _, ours, cfg = _moe_pair(True)
    assert SharedExpertsMoE.params(cfg) == {"mlp": (sum(p.numel() for p in ours.parameters()), 0)}
    d, m, moe = cfg.d_model, cfg.moe.d_expert, cfg.moe
    assert SharedExpertsMoE.active_weights(cfg) == d * moe.n_experts + moe.n_experts_per_token * 3 * d * m + (
        3 * d * moe.d_shared + d)


def test_ablating_the_shared_expert_removes_exactly_its_gated_write():
    model = HookedTransformer.from_hf(make_hf_family("qwen3_next"))
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    _, clean = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mlp."))
    hooks = expert_ablation_hooks(model, [Expert(0, "shared")], mode="zero")
    _, ablated = model.run_with_cache(tokens, fwd_hooks=hooks, names_filter=lambda n: n.startswith("blocks.0."))
    assert torch.equal(ablated["blocks.0.mlp.hook_routed_out"], clean["blocks.0.mlp.hook_routed_out"])
    assert torch.allclose(ablated["blocks.0.hook_mlp_out"], clean["blocks.0.mlp.hook_routed_out"], atol=1e-6)
    assert not torch.equal(clean["blocks.0.mlp.hook_shared_out"], torch.zeros_like(clean["blocks.0.mlp.hook_shared_out"]))


def test_the_multi_token_prediction_weights_are_left_unread(tmp_path):
    """A published checkpoint holds `mtp.*` tensors (the multi-token-prediction block), which transformers drops on
    load and no forward reads: loaded without them, the same model."""
    hf = make_hf_family("qwen3_next")
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {"mtp.fc.weight": torch.randn(32, 64), "mtp.norm.weight": torch.randn(32),
             "mtp.layers.0.mlp.shared_expert_gate.weight": torch.randn(1, 32)}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    model = HookedTransformer.from_pretrained(tmp_path)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-5


def test_the_info_counts_are_transformers_model_with_k_of_the_experts():
    """Total and active parameters (`lenskit info`) against transformers' model built on the meta device from the
    published config: active is everything but the (n_experts - k) / n_experts of each sparse block's routed experts
    that a token leaves idle; the shared expert and its gate count in full."""
    from lenskit import accounting

    with torch.device("meta"):
        hf = Qwen3NextForCausalLM(Qwen3NextConfig.from_dict(PUBLISHED))
    total = sum(p.numel() for p in hf.parameters())
    idle = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
               for layer in hf.model.layers if isinstance(layer.mlp, Qwen3NextSparseMoeBlock)) * (512 - 10) // 512
    counts = accounting.param_summary("qwen3-next-80b-a3b")["value"]
    assert (counts["total"], counts["active"]) == (total, total - idle)
    assert counts["total"] == pytest.approx(80e9, rel=0.01) and counts["active"] == pytest.approx(3.9e9, rel=0.01)
