"""The DeepSeek V3 pieces (latent attention, shared-experts MoE) composed by hand into a whole model equal
transformers' DeepseekV3ForCausalLM in fp32: logits, every block's stream, and greedy generation with each side's own
cache. The config and the weight names are written out here; the `deepseek_v3` family module (its reader and checkpoint
layout) replaces them with the registry's golden tests when it lands.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from lenskit import HookedTransformer, ModelConfig

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
D_EXPERT = 16
BLOCK_NAMES = {  # lenskit's name inside a block -> transformers'
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    "attn.q_a.weight": "self_attn.q_a_proj.weight", "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b.weight": "self_attn.q_b_proj.weight", "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn.kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.out.weight": "self_attn.o_proj.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.fc_in.weight": "mlp.up_proj.weight", "mlp.fc_out.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight", "mlp.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared.gate.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared.fc_in.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared.fc_out.weight": "mlp.shared_experts.down_proj.weight"}


def pair():
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=D_EXPERT, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
        rope_parameters=dict(YARN), tie_word_embeddings=False, rms_norm_eps=1e-6)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms near 1, the rest far from transformers' tiny init
            p.normal_(std=0.1).add_(1.0) if "norm" in name else p.normal_(std=0.3)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.3)
    gain = 0.1 * math.log(YARN["factor"]) + 1.0  # mscale and mscale_all_dim are both 1: attention factor gain / gain
    cfg = ModelConfig(
        3, 32, 4, 101, 64, d_head=12, d_mlp=48, positional="rotary", norm="rmsnorm", mlp="swiglu", norm_eps=1e-6,
        qkv_bias=False, out_bias=False, rotary_dim=8, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        rope_type="yarn", rope_factor=4.0, rope_original_n_ctx=16, rope_attention_factor=gain / gain,
        rope_mscale_all_dim=1.0, family="llama", tie_word_embeddings=False, n_experts=8, n_experts_per_token=2,
        d_expert=D_EXPERT, routing="sigmoid_group_topk_renorm", n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, dense_layers=(0,))
    model = HookedTransformer(cfg).eval()
    theirs = hf.state_dict()
    ours = {"embed.weight": theirs["model.embed_tokens.weight"], "ln_final.weight": theirs["model.norm.weight"],
            "unembed.weight": theirs["lm_head.weight"]}
    for name in model.state_dict():
        if not name.startswith("blocks."):
            continue
        _, layer, rest = name.split(".", 2)
        if rest.startswith("mlp.experts."):  # transformers fuses each expert's gate and up rows, gate first
            _, _, e, proj, _ = rest.split(".")
            fused = theirs[f"model.layers.{layer}.mlp.experts.gate_up_proj"][int(e)]
            down = theirs[f"model.layers.{layer}.mlp.experts.down_proj"][int(e)]
            ours[name] = {"gate": fused[:D_EXPERT], "fc_in": fused[D_EXPERT:], "fc_out": down}[proj]
        else:
            ours[name] = theirs[f"model.layers.{layer}.{BLOCK_NAMES[rest]}"]
    model.load_state_dict(ours)  # strict: every name of ours mapped
    return hf, model


@pytest.fixture(scope="module")
def models():
    return pair()


TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(1))


def test_logits_and_every_stream_are_transformers(models):
    hf, model = models
    with torch.no_grad():
        want = hf(TOKENS, output_hidden_states=True)
        logits, cache = model.run_with_cache(TOKENS)
    assert (logits - want.logits).abs().max().item() < 1e-5
    for layer in range(2):  # transformers' last hidden state is after the final norm; the logits cover block 2
        assert (cache[f"blocks.{layer}.hook_resid_post"] - want.hidden_states[layer + 1]).abs().max().item() < 1e-5
    for layer in range(3):  # every residual write adds up
        mid = cache[f"blocks.{layer}.hook_resid_pre"] + cache[f"blocks.{layer}.hook_attn_out"]
        assert torch.equal(mid, cache[f"blocks.{layer}.hook_resid_mid"])
        assert torch.equal(mid + cache[f"blocks.{layer}.hook_mlp_out"], cache[f"blocks.{layer}.hook_resid_post"])


def test_greedy_generation_is_transformers(models):
    hf, model = models
    with torch.no_grad():
        want = hf.generate(TOKENS[:, :6], attention_mask=torch.ones(2, 6, dtype=torch.long), max_new_tokens=6,
                           min_new_tokens=6, do_sample=False, pad_token_id=0)
        got = model.generate(TOKENS[:, :6], max_new_tokens=6, stop_at_eos=False)
    assert torch.equal(got, want)


def test_fold_ln_keeps_the_logits_and_the_rest_is_refused_by_name(models):
    from lenskit.processing import process_weights

    _, model = models
    folded = process_weights(model, fold_ln=True)
    with torch.no_grad():
        assert (folded(TOKENS) - model(TOKENS)).abs().max().item() < 1e-4
    assert torch.equal(folded.blocks[1].attn.kv_a_norm.weight, model.blocks[1].attn.kv_a_norm.weight)  # not ln1's
    assert (folded.blocks[1].ln1.weight == 1).all() and (folded.blocks[1].ln2.weight == 1).all()
    for option, match in (("fold_value_biases", "nothing to fold in latent attention"),
                          ("refactor_factored_attn_matrices", "refactor_factored_attn_matrices is not defined")):
        with pytest.raises(ValueError, match=match) as e:
            process_weights(model, **{option: True})
        assert "\n" not in str(e.value)
