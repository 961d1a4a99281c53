"""Multi-head latent attention (lenskit.pieces.latent_attention) against transformers' own DeepseekV3Attention, in
fp32: with and without the q LoRA, plain and YaRN rotary (mscale_all_dim in the scale), interleaved and half-split
rotary layouts; its pattern and latents as transformers computes them; the latent KV cache giving the full forward's
logits step by step (fused and eager paths); hooks with their documented shapes; per-head results; parameter counts;
and one-line refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from families import family_model_of
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from lenskit import HookedTransformer, ModelConfig
from lenskit.kv_cache import KVCache, Latents
from lenskit.pieces.latent_attention import LatentAttention

D_MODEL, HEADS, NOPE, ROPE, V, KV_RANK, Q_RANK = 64, 4, 8, 8, 12, 16, 24
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
PLAIN = {"rope_type": "default", "rope_theta": 10000.0}


def hf_config(q_rank: int | None, rope: dict, interleave: bool) -> DeepseekV3Config:
    hf = DeepseekV3Config(vocab_size=100, hidden_size=D_MODEL, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                          q_lora_rank=q_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                          v_head_dim=V, max_position_embeddings=64, num_hidden_layers=1, rope_parameters=dict(rope),
                          rope_interleave=interleave)
    hf._attn_implementation = "eager"  # returns the pattern it used
    return hf


def lenskit_config(q_rank: int | None, rope: dict, interleave: bool, **more) -> ModelConfig:
    """The ModelConfig the DeepSeek V3 reader will give for hf_config's fields (written out here)."""
    yarn = {}
    if rope["rope_type"] == "yarn":  # transformers' attention factor where mscale and mscale_all_dim are both set
        get = lambda m: 0.1 * m * math.log(rope["factor"]) + 1.0  # noqa: E731
        yarn = dict(rope_type="yarn", rope_factor=rope["factor"], rope_original_n_ctx=rope["original_max_position_embeddings"],
                    rope_attention_factor=get(rope["mscale"]) / get(rope["mscale_all_dim"]),
                    rope_mscale_all_dim=rope["mscale_all_dim"])
    fields = dict(n_layers=1, d_model=D_MODEL, n_heads=HEADS, d_vocab=100, n_ctx=64, d_head=V, positional="rotary",
                  norm="rmsnorm", mlp="swiglu", qkv_bias=False, out_bias=False, rotary_dim=ROPE, kv_lora_rank=KV_RANK,
                  q_lora_rank=q_rank, qk_nope_head_dim=NOPE, rope_interleave=interleave, family="llama", **yarn)
    return ModelConfig(**{**fields, **more})


def copied(ref: DeepseekV3Attention, cfg: ModelConfig) -> LatentAttention:
    mine = LatentAttention(cfg)
    names = {"kv_a": ref.kv_a_proj_with_mqa, "kv_a_norm": ref.kv_a_layernorm, "kv_b": ref.kv_b_proj, "out": ref.o_proj}
    names.update({"q_proj": ref.q_proj} if ref.q_lora_rank is None else
                 {"q_a": ref.q_a_proj, "q_a_norm": ref.q_a_layernorm, "q_b": ref.q_b_proj})
    mine.load_state_dict({f"{ours}.{k}": v for ours, module in names.items() for k, v in module.state_dict().items()})
    return mine


def reference_pair(q_rank, rope, interleave, seed=0):
    torch.manual_seed(seed)
    hf = hf_config(q_rank, rope, interleave)
    ref = DeepseekV3Attention(hf, 0).float().eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return hf, ref, copied(ref, lenskit_config(q_rank, rope, interleave))


CASES = [(Q_RANK, YARN, True), (None, YARN, True), (Q_RANK, PLAIN, True), (None, PLAIN, False), (Q_RANK, YARN, False)]


@pytest.mark.parametrize("q_rank, rope, interleave", CASES)
def test_output_and_pattern_are_transformers(q_rank, rope, interleave):
    hf, ref, mine = reference_pair(q_rank, rope, interleave)
    x = torch.randn(2, 11, D_MODEL, generator=torch.Generator().manual_seed(1))
    cos, sin = DeepseekV3RotaryEmbedding(hf)(x, torch.arange(11)[None].expand(2, -1))
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    seen = {}
    with torch.no_grad():
        want, want_pattern = ref(x, (cos, sin), causal)
        fused = mine(x)
        def keep(name):
            def hook(t, hook):
                seen[name] = t
                return t + 0 if name == "hook_pattern" else None  # a returned pattern takes the eager path
            return hook

        handles = [getattr(mine, n).add_hook(keep(n)) for n in ("hook_pattern", "hook_kv_latent", "hook_k_rope")]
        try:
            eager = mine(x)
        finally:
            for handle in handles:
                handle.remove()
        latent = ref.kv_a_proj_with_mqa(x)[..., :KV_RANK]
    assert mine.scale == ref.scaling  # the same float, mscale folded in the same order
    assert (fused - want).abs().max().item() < 1e-5
    assert (eager - want).abs().max().item() < 1e-5
    assert (seen["hook_pattern"] - want_pattern).abs().max().item() < 1e-6
    assert torch.equal(seen["hook_kv_latent"], ref.kv_a_layernorm(latent))
    assert seen["hook_k_rope"].shape == (2, 11, ROPE)
    if rope is YARN:  # the scale really is scaled: (0.1 ln 4 + 1) ** 2 over the head's 16 features
        assert mine.scale == pytest.approx((NOPE + ROPE) ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)


def test_the_interleaved_layout_matters():
    """The two layouts disagree on the same weights (so the parity above checks the right one)."""
    _, _, interleaved = reference_pair(Q_RANK, PLAIN, True)
    half = LatentAttention(lenskit_config(Q_RANK, PLAIN, False))
    half.load_state_dict(interleaved.state_dict())
    x = torch.randn(1, 6, D_MODEL, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (interleaved(x) - half(x)).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------ inside a model
@pytest.fixture(scope="module")
def model():
    cfg = lenskit_config(Q_RANK, YARN, True, n_layers=2, d_mlp=48, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = HookedTransformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.2)
    return m


TOKENS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("eager", [False, True])
def test_the_latent_cache_gives_the_full_forwards_logits(model, eager):
    hooks = [(lambda n: n.endswith("hook_pattern"), lambda t, hook: t + 0)] if eager else []  # returned: the eager path
    with torch.no_grad(), model.hooks(hooks):
        want = model(TOKENS)
        cache = KVCache(model.cfg, 2)
        steps = [model(TOKENS[:, :5], past_kv_cache=cache), model(TOKENS[:, 5:8], past_kv_cache=cache)]
        steps += [model(TOKENS[:, i:i + 1], past_kv_cache=cache) for i in range(8, 12)]
    assert (torch.cat(steps, dim=1) - want).abs().max().item() < 1e-5
    entry = cache[1]
    assert isinstance(entry, Latents) and cache.n_pos == 12
    assert entry.latent.shape == (2, 12, KV_RANK) and entry.k_rope.shape == (2, 12, ROPE)  # not the expanded keys


def test_generation_with_the_latent_cache_is_generation_without_it(model):
    with torch.no_grad():
        cached = model.generate(TOKENS[:, :6], max_new_tokens=5, stop_at_eos=False)
        uncached = model.generate(TOKENS[:, :6], max_new_tokens=5, stop_at_eos=False, use_past_kv_cache=False)
    assert cached.shape == (2, 11) and torch.equal(cached, uncached)


def test_a_hook_returning_q_or_k_laid_out_otherwise_leaves_the_logits_bit_for_bit():
    """q and k are stored head by head for the kernel; a hook that returns the same values position by position (a
    contiguous copy) must not change the scores' last bits, as patching compares runs bit for bit. (The registry's
    tiny DeepSeek V3 is one whose keys' last bits moved with their layout.)"""
    model = family_model_of("deepseek_v3").model
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(3))

    def pos_major(t, hook):
        assert t.transpose(1, 2).is_contiguous()  # the forward's own layout: head by head
        return t.contiguous()

    with torch.no_grad():
        want = model(tokens)
        for site in ("q", "k"):
            hooks = [(f"blocks.{i}.attn.hook_{site}", pos_major) for i in range(model.cfg.n_layers)]
            assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=hooks), want), site


def test_hooks_fire_with_their_documented_shapes(model):
    names = ["hook_q_latent", "hook_kv_latent", "hook_k_rope", "hook_q", "hook_k", "hook_v", "hook_attn_scores",
             "hook_pattern", "hook_z", "hook_result"]
    shapes = {}
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith("blocks.1."))
        model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.1.attn.{n}", lambda t, hook: shapes.__setitem__(hook.name, t.shape))
                                                for n in names])
    b, p, h = 2, 12, HEADS
    want = {"hook_q_latent": (b, p, Q_RANK), "hook_kv_latent": (b, p, KV_RANK), "hook_k_rope": (b, p, ROPE),
            "hook_q": (b, p, h, NOPE + ROPE), "hook_k": (b, p, h, NOPE + ROPE), "hook_v": (b, p, h, V),
            "hook_attn_scores": (b, h, p, p), "hook_pattern": (b, h, p, p), "hook_z": (b, p, h, V),
            "hook_result": (b, p, h, D_MODEL)}
    assert {n.split(".")[-1]: tuple(s) for n, s in shapes.items()} == want
    # each head's result sums (with the bias) to the attention's write, as for ordinary attention
    with torch.no_grad():
        _, full = model.run_with_cache(TOKENS, names_filter=lambda n: n in ("blocks.1.attn.hook_result", "blocks.1.hook_attn_out"))
    attn = model.blocks[1].attn
    assert (full["blocks.1.attn.hook_result"].sum(2) + attn.b_O - full["blocks.1.hook_attn_out"]).abs().max() < 1e-5
    assert (cache["blocks.1.hook_resid_pre"] + cache["blocks.1.hook_attn_out"] - cache["blocks.1.hook_resid_mid"]).abs().max() < 1e-6
    assert torch.equal(cache["kv_latent", 1], cache["blocks.1.attn.hook_kv_latent"])  # the short names reach them
    assert torch.equal(cache["k_rope", -1], cache["blocks.1.attn.hook_k_rope"])


def test_zeroing_a_head_removes_its_result(model):
    with torch.no_grad():
        _, clean = model.run_with_cache(TOKENS, names_filter=lambda n: n in ("blocks.0.attn.hook_result", "blocks.0.hook_attn_out"))

        def zero_head(z, hook):
            z[:, :, 2] = 0
            return z

        _, ablated = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_attn_out",
                                          fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    want = clean["blocks.0.hook_attn_out"] - clean["blocks.0.attn.hook_result"][:, :, 2]
    assert (ablated["blocks.0.hook_attn_out"] - want).abs().max().item() < 1e-5


def test_params_count_the_modules_weights():
    for q_rank in (None, Q_RANK):
        for bias in (False, True):
            cfg = lenskit_config(q_rank, PLAIN, True, qkv_bias=bias, out_bias=bias)
            attn = LatentAttention(cfg)
            counts = LatentAttention.params(cfg)
            norms = sum(p.numel() for n, p in attn.named_parameters() if "norm" in n)
            biases = sum(p.numel() for n, p in attn.named_parameters() if n.endswith("bias"))
            weights = sum(p.numel() for n, p in attn.named_parameters() if "norm" not in n and n.endswith("weight"))
            assert counts == {"attn": (weights, biases), "norms": (norms, 0)}


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("fields, match", [
    (dict(kv_lora_rank=None, q_lora_rank=8), "kv_lora_rank is None"),
    (dict(qk_nope_head_dim=None), "qk_nope_head_dim must be an int"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be None or a positive int"),
    (dict(positional="learned", rotary_dim=None), "needs positional='rotary'"),
    (dict(n_kv_heads=2), "n_kv_heads == n_heads"),
    (dict(attn_softcap=30.0), "attn_softcap is not implemented with latent attention"),
    (dict(rope_mscale_all_dim=1.0), "rope_mscale_all_dim"),
    (dict(rope_interleave="yes"), "rope_interleave must be True or False"),
    (dict(rotary_dim=7), "rotary_dim=7 must be an even int above 0"),
])
def test_bad_configs_are_refused_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as e:
        lenskit_config(Q_RANK, PLAIN, True, **fields)
    assert "\n" not in str(e.value)


def test_what_latent_attention_lacks_is_refused_by_name(model):
    attn = model.blocks[0].attn
    for name in ("W_Q", "W_K", "b_V"):
        with pytest.raises(ValueError, match=f"no per-head {name}") as e:
            getattr(attn, name)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no per-head W_Q"):
        model.W_Q  # noqa: B018 - the stacked view asks each block
    assert attn.W_O.shape == (HEADS, V, D_MODEL)
    with pytest.raises(ValueError, match="no per-head q/k/v inputs"):
        attn.from_projections(None, None, None)
    for switch in (model.set_use_split_qkv_input, model.set_use_attn_in):
        with pytest.raises(ValueError, match="attention is latent") as e:
            switch(True)
        assert "\n" not in str(e.value)
    assert not hasattr(model.blocks[0], "hook_q_input")  # refused before anything changed
    with pytest.raises(ValueError, match="needs cfg.mla.kv_lora_rank"):
        LatentAttention(ModelConfig.from_name("gpt2"))
