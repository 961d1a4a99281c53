"""The Gated DeltaNet piece (lenskit.pieces.deltanet) against transformers' own Qwen 3.5 layer (its torch path:
neither fla nor causal-conv1d is installed for the tests) and against the plain recurrence."""

from __future__ import annotations

import pytest
import torch
import transformers
from golden import max_diff
from transformers.models.qwen3_5 import modeling_qwen3_5 as theirs

from lenskit import ModelConfig
from lenskit.pieces.deltanet import GatedDeltaNet, chunked_gated_delta_rule, recurrent_gated_delta_rule

# Two q/k heads serving four value heads, d_k != d_v, a kernel of 4.
SHAPE = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
             rms_norm_eps=1e-6)


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    hf = theirs.Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**SHAPE), layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.rand_like(hf.A_log) * 2 - 2)  # decays from fast to slow
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=4, d_vocab=11, n_ctx=512, norm_eps=1e-6, layer_types=("linear",),
                      linear_n_k_heads=2, linear_n_v_heads=4, linear_d_k=8, linear_d_v=6, linear_conv_width=4)
    ours = GatedDeltaNet(cfg)
    names = {"in_qkv.weight": "in_proj_qkv.weight", "in_z.weight": "in_proj_z.weight", "in_b.weight": "in_proj_b.weight",
             "in_a.weight": "in_proj_a.weight", "conv_weight": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias",
             "out_norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}
    hf_state = hf.state_dict()
    ours.load_state_dict({k: hf_state[v] for k, v in names.items()})
    return hf, ours


@pytest.mark.parametrize("pos", [150, 128, 5])  # longer than two chunks and not a multiple of 64, a multiple, shorter than one
def test_layer_matches_transformers_torch_path(pos):
    hf, ours = _pair()
    x = torch.randn(3, pos, 32, generator=torch.Generator().manual_seed(pos))
    with torch.no_grad():
        want = hf(x)
        assert max_diff(ours(x), want) <= 1e-5
        ours.rule = recurrent_gated_delta_rule
        assert max_diff(ours(x), want) <= 1e-5


def test_chunked_rule_equals_the_recurrence_and_its_state():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 150, 2, 8, generator=gen), torch.randn(2, 150, 2, 8, generator=gen)
    v = torch.randn(2, 150, 4, 6, generator=gen)
    beta = torch.rand(2, 150, 4, generator=gen)
    g = -torch.rand(2, 150, 4, generator=gen) * 3
    out, state = chunked_gated_delta_rule(q, k, v, beta, g)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, beta, g)
    assert out.shape == (2, 150, 4, 6) and state.shape == (2, 4, 8, 6)
    assert max_diff(out, ref_out) <= 1e-5 and max_diff(state, ref_state) <= 1e-5
    for chunk in (1, 7, 64, 256):
        assert max_diff(chunked_gated_delta_rule(q, k, v, beta, g, chunk=chunk)[0], ref_out) <= 1e-5
    # transformers' own torch functions compute the same outputs and final state
    for fn in (theirs.torch_chunk_gated_delta_rule, theirs.torch_recurrent_gated_delta_rule):
        their_out, their_state = fn(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert max_diff(their_out, ref_out) <= 1e-5 and max_diff(their_state, ref_state) <= 1e-5


def test_hooks_see_the_gates_and_the_state_on_request():
    from lenskit.observe.hooks import HookedRootModule

    hf, ours = _pair(1)

    class Root(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.attn = ours
            self.setup_hooks()

    root, x = Root(), torch.randn(2, 70, 32)
    seen = {}
    save = lambda t, hook: seen.__setitem__(hook.name, t)  # noqa: E731
    with torch.no_grad(), root.hooks([(n, save) for n in root.hook_dict]):
        root.attn(x)
    assert seen["attn.hook_q"].shape == seen["attn.hook_k"].shape == (2, 70, 2, 8)
    assert seen["attn.hook_v"].shape == (2, 70, 4, 6) and seen["attn.hook_z"].shape == (2, 70, 4, 6)
    beta, g = seen["attn.hook_beta"], seen["attn.hook_g"]
    assert beta.shape == g.shape == (2, 70, 4) and bool(((beta > 0) & (beta < 1)).all()) and bool((g <= 0).all())
    _, state = recurrent_gated_delta_rule(seen["attn.hook_q"], seen["attn.hook_k"], seen["attn.hook_v"], beta, g)
    assert seen["attn.hook_state"].shape == (2, 4, 8, 6) and max_diff(seen["attn.hook_state"], state) <= 1e-5
    # an edit of a gate reaches the output: no write at all leaves every state, and so the output, zero
    with torch.no_grad(), root.hooks([("attn.hook_beta", lambda t, hook: torch.zeros_like(t))]):
        assert root.attn(x).abs().max() == 0


def test_bf16_layer_rounds_as_transformers_does():
    """In bf16 the rule still runs in fp32 and the gated norm casts where transformers casts: the outputs agree to
    bf16's rounding."""
    hf, ours = _pair(3)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        got, want = ours(x), hf(x)
    assert got.dtype == torch.bfloat16 and max_diff(got, want) <= 1e-2 * want.abs().max().item()


def test_left_padding_under_transformers_mask_is_each_prompt_alone():
    """transformers zeroes a linear-attention layer's padded inputs (its 2-D attention mask): zeros before a prompt
    leave the convolution's window and the state as a fresh prompt has them, so a left-padded row under the mask is
    the prompt alone, which is what lenskit computes for it (lenskit takes no mask; right padding never reaches the
    real positions of a causal layer)."""
    hf, ours = _pair(5)
    gen = torch.Generator().manual_seed(6)
    lengths = (150, 70, 3)
    prompts = [torch.randn(n, 32, generator=gen) for n in lengths]
    batch = torch.zeros(3, 150, 32) + 7.0  # padding that would matter if it were read
    mask = torch.zeros(3, 150, dtype=torch.long)
    for row, p in enumerate(prompts):
        batch[row, 150 - len(p):], mask[row, 150 - len(p):] = p, 1
    with torch.no_grad():
        theirs = hf(batch, attention_mask=mask)
        for row, p in enumerate(prompts):
            alone = ours(p[None])[0]
            assert max_diff(theirs[row, 150 - len(p):], alone) <= 1e-5
