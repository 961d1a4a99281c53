"""DeepSeek V3's mixture of experts (lenskit.pieces.shared_experts) against transformers' own DeepseekV3MoE, in fp32,
token by token: group-limited top k, the correction bias, norm_topk_prob, routed_scaling_factor and the shared
experts; the rule by hand (the bias steers the choice and never the weights; a losing group's best expert is not
chosen); hooks and the identity mlp_out = routed_out + shared_out; expert ablation of shared and routed experts; and
one-line refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from lenskit import HookedTransformer, ModelConfig
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.pieces.shared_experts import SharedExpertsMoE, grouped_sigmoid_topk

D_MODEL, D_EXPERT = 32, 16


def lenskit_config(n_experts=8, k=3, n_group=4, topk_group=2, shared=2, renorm=True, scaling=2.5, **more) -> ModelConfig:
    fields = dict(n_layers=2, d_model=D_MODEL, n_heads=4, d_vocab=100, n_ctx=64, norm="rmsnorm", mlp="swiglu",
                  positional="rotary", family="llama", n_experts=n_experts, n_experts_per_token=k, d_expert=D_EXPERT,
                  routing="sigmoid_group_topk_renorm" if renorm else "sigmoid_group_topk", n_group=n_group,
                  topk_group=topk_group, n_shared_experts=shared, routed_scaling_factor=scaling, d_mlp=48)
    return ModelConfig(**{**fields, **more})


def reference_pair(n_experts, k, n_group, topk_group, shared, renorm, seed=0):
    torch.manual_seed(seed)
    hf = DeepseekV3Config(vocab_size=100, hidden_size=D_MODEL, n_routed_experts=n_experts, num_experts_per_tok=k,
                          n_group=n_group, topk_group=topk_group, n_shared_experts=shared, moe_intermediate_size=D_EXPERT,
                          routed_scaling_factor=2.5, norm_topk_prob=renorm)
    ref = DeepseekV3MoE(hf).float().eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ref.gate.e_score_correction_bias.normal_(std=0.3)  # a trained model's bias is far from zero
    mine = SharedExpertsMoE(lenskit_config(n_experts, k, n_group, topk_group, shared, renorm))
    state = {"router.weight": ref.gate.weight, "e_score_correction_bias": ref.gate.e_score_correction_bias}
    if shared:  # transformers builds a zero-wide MLP for none; lenskit none at all
        state |= {"shared.gate.weight": ref.shared_experts.gate_proj.weight,
                  "shared.fc_in.weight": ref.shared_experts.up_proj.weight,
                  "shared.fc_out.weight": ref.shared_experts.down_proj.weight}
    for e in range(n_experts):  # transformers fuses each expert's gate and up rows, gate first
        state |= {f"experts.{e}.gate.weight": ref.experts.gate_up_proj[e, :D_EXPERT],
                  f"experts.{e}.fc_in.weight": ref.experts.gate_up_proj[e, D_EXPERT:],
                  f"experts.{e}.fc_out.weight": ref.experts.down_proj[e]}
    mine.load_state_dict(state)
    return ref, mine


@pytest.mark.parametrize("n_experts, k, n_group, topk_group, shared, renorm", [
    (8, 3, 4, 2, 2, True),  # group-limited: 4 of the 8 experts open to each token
    (8, 2, 1, 1, 1, False),  # one group, no renormalisation
    (16, 4, 4, 1, 1, True),  # a single group of 4 open: every k experts from it
    (8, 2, 2, 1, 0, True),  # no shared experts
])
def test_routing_and_output_are_transformers(n_experts, k, n_group, topk_group, shared, renorm):
    ref, mine = reference_pair(n_experts, k, n_group, topk_group, shared, renorm)
    x = torch.randn(3, 9, D_MODEL, generator=torch.Generator().manual_seed(1))
    seen = {}
    handles = [getattr(mine, n).add_hook(lambda t, hook, n=n: seen.__setitem__(n, t))
               for n in ("hook_router_logits", "hook_expert_indices", "hook_expert_weights")]
    try:
        with torch.no_grad():
            want = ref(x)
            logits, weights, indices = ref.gate(x)
            got = mine(x)
    finally:
        for handle in handles:
            handle.remove()
    assert (got - want).abs().max().item() < 1e-5
    assert (seen["hook_router_logits"].reshape(-1, n_experts) - logits).abs().max().item() < 1e-6
    mine_i, order = seen["hook_expert_indices"].reshape(-1, k).sort(-1)  # transformers' order is topk(sorted=False)'s
    ref_i, ref_order = indices.sort(-1)
    assert torch.equal(mine_i, ref_i)
    assert torch.allclose(seen["hook_expert_weights"].reshape(-1, k).gather(-1, order), weights.gather(-1, ref_order),
                          atol=1e-6)
    if n_group > 1:  # every token's experts lie in at most topk_group groups
        groups = ref_i // (n_experts // n_group)
        assert max(len(set(row)) for row in groups.tolist()) <= topk_group


def test_the_correction_bias_steers_the_choice_and_never_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sig = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.0, -1.0)]
    plain = dict(n_group=1, topk_group=1, renorm=False, scaling=1.0)
    w, i = grouped_sigmoid_topk(logits, 2, torch.zeros(4), **plain)
    assert i.tolist() == [[0, 1]] and w[0].tolist() == pytest.approx([sig[0], sig[1]])
    w, i = grouped_sigmoid_topk(logits, 2, torch.tensor([0.0, 0.0, 0.0, 1.0]), **plain)  # expert 3: 0.27 + 1 beats all
    assert i.tolist() == [[3, 0]] and w[0].tolist() == pytest.approx([sig[3], sig[0]])  # its weight is its score alone
    w, i = grouped_sigmoid_topk(logits, 2, torch.tensor([0.0, 0.0, 0.0, 1.0]), n_group=1, topk_group=1, renorm=True,
                                scaling=2.5)
    assert w[0].tolist() == pytest.approx([2.5 * sig[3] / (sig[3] + sig[0]), 2.5 * sig[0] / (sig[3] + sig[0])])


def test_a_losing_groups_best_expert_is_not_chosen():
    # groups {0, 1} and {2, 3}; group 0 scores by its two best (0.95 + 0.05), group 1 by (0.7 + 0.6): group 1 wins,
    # so expert 0, the single best, is passed over
    scores = torch.tensor([[0.95, 0.05, 0.7, 0.6]])
    logits = torch.log(scores / (1 - scores))
    w, i = grouped_sigmoid_topk(logits, 2, torch.zeros(4), n_group=2, topk_group=1, renorm=False, scaling=1.0)
    assert i.tolist() == [[2, 3]] and w[0].tolist() == pytest.approx([0.7, 0.6])
    w, i = grouped_sigmoid_topk(logits, 2, torch.zeros(4), n_group=2, topk_group=2, renorm=False, scaling=1.0)
    assert i.tolist() == [[0, 2]]


# ------------------------------------------------------------------------------------------ inside a model
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HookedTransformer(lenskit_config(dense_layers=(0,))).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.2)
        m.blocks[1].mlp.e_score_correction_bias.normal_(std=0.3)
    return m


TOKENS = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
NAMES = ("blocks.1.hook_mlp_out", "blocks.1.mlp.hook_routed_out", "blocks.1.mlp.hook_shared_out",
         "blocks.1.mlp.hook_expert_indices", "blocks.1.hook_resid_mid", "blocks.1.hook_resid_post")


def run(model, hooks=()):
    with torch.no_grad():
        return model.run_with_cache(TOKENS, names_filter=lambda n: n in NAMES, fwd_hooks=list(hooks))[1]


def test_mlp_out_is_routed_plus_shared(model):
    cache = run(model)
    mlp = model.blocks[1].mlp
    assert type(mlp) is SharedExpertsMoE and type(model.blocks[0].mlp) is not SharedExpertsMoE  # dense_layers
    assert torch.equal(cache["blocks.1.mlp.hook_routed_out"] + cache["blocks.1.mlp.hook_shared_out"],
                       cache["blocks.1.hook_mlp_out"])
    with torch.no_grad():
        normed = model.blocks[1].ln2(cache["blocks.1.hook_resid_mid"])
        assert torch.equal(cache["blocks.1.mlp.hook_shared_out"], mlp.shared(normed))
    assert cache["blocks.1.mlp.hook_shared_out"].shape == (2, 10, D_MODEL)
    assert torch.equal(cache["shared_out", 1], cache["blocks.1.mlp.hook_shared_out"])


def test_ablating_the_shared_experts_leaves_the_routed_write(model):
    clean = run(model)
    ablated = run(model, expert_ablation_hooks(model, Expert(1, "shared")))
    assert ablated["blocks.1.mlp.hook_shared_out"].abs().max() == 0
    assert torch.equal(ablated["blocks.1.hook_mlp_out"], clean["blocks.1.mlp.hook_routed_out"])
    at_3 = run(model, expert_ablation_hooks(model, Expert(1, "shared"), positions=[3]))
    assert at_3["blocks.1.mlp.hook_shared_out"][:, 3].abs().max() == 0
    assert torch.equal(at_3["blocks.1.mlp.hook_shared_out"][:, :3], clean["blocks.1.mlp.hook_shared_out"][:, :3])
    with pytest.raises(ValueError, match="shared experts are not routed"):
        expert_ablation_hooks(model, Expert(1, "shared"), mode="reroute")
    with pytest.raises(ValueError, match="no experts"):  # block 0 is dense
        expert_ablation_hooks(model, Expert(0, "shared"))


def test_rerouting_removes_an_expert_whatever_its_bias(model):
    mlp = model.blocks[1].mlp
    clean = run(model)
    favourite = clean["blocks.1.mlp.hook_expert_indices"].flatten().mode().values.item()
    saved = mlp.e_score_correction_bias.clone()
    try:
        with torch.no_grad():
            mlp.e_score_correction_bias[favourite] = 100.0  # chosen by every token, unless rerouted
        assert (run(model)["blocks.1.mlp.hook_expert_indices"] == favourite).any(-1).all()
        rerouted = run(model, expert_ablation_hooks(model, Expert(1, favourite), mode="reroute"))
    finally:
        with torch.no_grad():
            mlp.e_score_correction_bias.copy_(saved)
    assert not (rerouted["blocks.1.mlp.hook_expert_indices"] == favourite).any()


def test_params_count_the_modules_weights():
    for shared in (0, 2):
        cfg = lenskit_config(shared=shared)
        moe = SharedExpertsMoE(cfg)
        assert SharedExpertsMoE.params(cfg) == {"mlp": (sum(p.numel() for p in moe.parameters()), 0)}
        routed = 3 * D_MODEL * D_EXPERT  # one expert's gate, up and down
        assert SharedExpertsMoE.active_weights(cfg) == moe.router.weight.numel() + 3 * routed + (
            0 if shared == 0 else sum(p.numel() for p in moe.shared.parameters()))


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("fields, match", [
    (dict(n_group=3), "n_group=3 must divide n_experts=8"),
    (dict(n_group=8, topk_group=1), "groups of at least 2"),
    (dict(n_group=4, topk_group=5), "topk_group=5 must be <= n_group=4"),
    (dict(n_group=4, topk_group=1, k=3), "must hold at least n_experts_per_token=3"),
    (dict(shared=-1), "n_shared_experts must be an int >= 0"),
    (dict(routing="softmax_topk_renorm"), "n_group is a setting of DeepSeek's routing"),
    (dict(mlp="geglu"), "shared experts are dense MLPs of the experts. kind"),
])
def test_bad_configs_are_refused_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as e:
        lenskit_config(**fields)
    assert "\n" not in str(e.value)


def test_each_piece_refuses_the_others_routing():
    from lenskit.pieces.moe import MoE

    with pytest.raises(ValueError, match="SharedExpertsMoE"):
        MoE(lenskit_config())
    with pytest.raises(ValueError, match="or has shared experts"):  # softmax routing with shared ones: Qwen3-Next, Granite 4
        SharedExpertsMoE(lenskit_config(routing="softmax_topk", n_group=1, topk_group=1, shared=0, scaling=1.0))
