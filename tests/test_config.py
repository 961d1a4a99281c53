"""ModelConfig: presets, conversion from Hugging Face configs, and refusal of what lenskit does not implement."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from lenskit import PRESETS, ModelConfig

# Published shapes of the four GPT-2 sizes (Radford et al. 2019, and the HF config.json files).
GPT2_SIZES = {
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}


@pytest.mark.parametrize("name", sorted(GPT2_SIZES))
def test_presets_match_published_shapes(name):
    cfg = ModelConfig.from_name(name)
    n_layers, d_model, n_heads = GPT2_SIZES[name]
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads) == (n_layers, d_model, n_heads)
    assert cfg.d_head == 64  # every GPT-2 size uses 64-dimensional heads
    assert cfg.d_mlp == 4 * d_model
    assert (cfg.d_vocab, cfg.n_ctx) == (50257, 1024)
    assert cfg.activation == "gelu_new" and cfg.gelu_approximate == "tanh"
    assert cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.tie_word_embeddings
    assert cfg.is_gpt2
    assert ModelConfig.from_name(f"openai-community/{name}") == cfg


def test_preset_matches_transformers_default_config():
    # transformers' GPT2Config() defaults are the 124M gpt2 model.
    assert ModelConfig.from_hf_config(transformers.GPT2Config(), name="gpt2") == PRESETS["gpt2"]


def test_unknown_preset_lists_the_presets():
    with pytest.raises(KeyError, match="gpt2-medium"):
        ModelConfig.from_name("gpt3")


def test_config_is_frozen():
    cfg = ModelConfig.from_name("gpt2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3  # type: ignore[misc]


def test_derived_fields():
    cfg = ModelConfig(n_layers=2, d_model=48, n_heads=3, d_vocab=10, n_ctx=8)
    assert cfg.d_head == 16 and cfg.d_mlp == 192
    explicit = ModelConfig(n_layers=2, d_model=48, n_heads=4, d_vocab=10, n_ctx=8, d_head=8, d_mlp=7)
    assert explicit.d_head == 8 and explicit.d_mlp == 7 and not explicit.is_gpt2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=50, n_heads=3), "n_heads"),
        (dict(n_layers=0), "n_layers"),
        (dict(d_vocab=-1), "d_vocab"),
        (dict(n_ctx=2.5), "n_ctx"),
        (dict(activation="silu"), "activation"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="moe"), "mlp"),
    ],
)
def test_bad_fields_raise_naming_the_field(kwargs, field):
    base = dict(n_layers=2, d_model=48, n_heads=3, d_vocab=10, n_ctx=8)
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**base, **kwargs})


def test_from_hf_config_small():
    hf = transformers.GPT2Config(n_layer=3, n_embd=40, n_head=5, vocab_size=77, n_positions=33,
                                 n_inner=100, layer_norm_epsilon=1e-6, activation_function="gelu",
                                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head) == (3, 40, 5, 8)
    assert (cfg.d_vocab, cfg.n_ctx, cfg.d_mlp) == (77, 33, 100)
    assert cfg.norm_eps == 1e-6
    assert cfg.activation == "gelu" and cfg.gelu_approximate == "none"  # HF's "gelu" is the exact erf GELU
    assert not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    # A dict (config.json contents) gives the same result as the config object.
    assert ModelConfig.from_hf_config(hf.to_dict()) == cfg


def test_to_hf_dict_round_trips_through_transformers(tmp_path):
    cfg = ModelConfig(n_layers=2, d_model=24, n_heads=3, d_vocab=50, n_ctx=16, d_mlp=60, norm_eps=1e-6,
                      tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    hf = transformers.GPT2Config.from_pretrained(str(tmp_path))
    assert (hf.n_layer, hf.n_embd, hf.n_head, hf.vocab_size, hf.n_positions, hf.n_inner) == (2, 24, 3, 50, 16, 60)
    assert ModelConfig.from_json(tmp_path / "config.json") == cfg
    assert ModelConfig.from_hf_config(hf) == cfg


def test_to_hf_dict_refuses_non_gpt2_architectures():
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=5, n_ctx=4, norm="rmsnorm")
    with pytest.raises(ValueError, match="rmsnorm"):
        cfg.to_hf_dict()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "bert"}, "model_type"),
        ({"activation_function": "silu"}, "activation_function"),
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        ({"scale_attn_weights": False}, "scale_attn_weights"),
    ],
)
def test_unsupported_hf_values_raise_naming_the_field(change, field):
    d = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2).to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(d)


def test_missing_model_type_and_fields_raise():
    d = transformers.GPT2Config().to_dict()
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({k: v for k, v in d.items() if k != "model_type"})
    with pytest.raises(ValueError, match="n_head"):
        ModelConfig.from_hf_config({k: v for k, v in d.items() if k != "n_head"})


def test_from_json_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_json(bad)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_json(tmp_path / "absent.json")


def test_replace_recomputes_derived_fields():
    cfg = ModelConfig.from_name("gpt2")
    small = cfg.replace(d_model=128, n_heads=4)
    assert small.d_head == 32 and small.d_mlp == 512
    assert small.n_layers == 12 and cfg.d_model == 768  # the original is untouched
    assert cfg.replace(n_heads=24).d_head == 32
    assert cfg.replace(d_model=128, n_heads=4, d_mlp=100).d_mlp == 100
    assert cfg.replace(n_layers=2).d_mlp == 3072  # fields not touched by the change stay
    with pytest.raises(ValueError, match="activation"):
        cfg.replace(activation="silu")


def _shrunk(name: str) -> ModelConfig:
    """Preset `name` at 2 layers, 16-wide heads, and as many heads as keep its GQA group (4 where it can)."""
    preset = PRESETS[name]
    group = preset.n_heads // preset.n_kv_heads
    n_heads = group * max(1, 4 // group)
    return preset.replace(n_layers=2, d_model=16 * n_heads, n_heads=n_heads, d_vocab=50, n_ctx=32)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_shrinks_and_runs(name):
    import torch

    from lenskit import HookedTransformer

    preset, small = PRESETS[name], _shrunk(name)
    assert (small.n_layers, small.d_head, small.d_vocab) == (2, 16, 50)
    assert small.n_heads // small.n_kv_heads == preset.n_heads // preset.n_kv_heads  # the GQA group is kept
    assert small.d_mlp == round(small.d_model * preset.d_mlp / preset.d_model)  # and the MLP's width ratio
    if preset.rope.dim is not None:  # and the rotary fraction of d_head: Pythia's quarter, the others' whole
        assert small.rope.dim / small.d_head == preset.rope.dim / preset.d_head
    if preset.attention.query_pre_attn_scalar == 1.0:  # Gemma 4's unscaled scores stay unscaled
        assert small.attention.query_pre_attn_scalar == 1.0
    elif preset.attention.query_pre_attn_scalar is not None:
        assert small.attention.query_pre_attn_scalar / small.d_head == preset.attention.query_pre_attn_scalar / preset.d_head
    if preset.attention.full_d_head is not None:  # and Gemma 4's full blocks their wider heads, and their GQA group where it fits
        assert small.attention.full_d_head / small.d_head == preset.attention.full_d_head / preset.d_head
        assert small.attention.full_n_kv_heads == (None if preset.attention.full_n_kv_heads is None else
                                         max(1, small.n_heads // (preset.n_heads // preset.attention.full_n_kv_heads)))
    # and Gemma 4's kv sharing its share of the blocks, where each sharing block has an earlier one of its type
    assert small.block.n_kv_shared_layers == preset.block.n_kv_shared_layers * 2 // preset.n_layers
    assert small.block.double_wide_mlp == (preset.block.double_wide_mlp and small.block.n_kv_shared_layers > 0)
    assert small.block.d_vocab_per_layer == (None if preset.block.d_per_layer is None else 50)  # per-layer inputs' table shrinks too
    if preset.layer_types is not None:
        assert small.layer_types == preset.layer_types[:2]
    assert small.nope_layers == tuple(i for i in preset.nope_layers if i < 2)  # blocks without rotary (SmolLM3)
    assert small.moe.dense_layers == tuple(i for i in preset.moe.dense_layers if i < 2)  # DeepSeek V3's first dense blocks
    ours, theirs = small.to_flat_dict(), preset.to_flat_dict()  # every setting by its flat name
    same = set(theirs) - {
        "n_layers", "d_model", "n_heads", "d_vocab", "n_ctx", "d_head", "n_kv_heads", "d_mlp", "rotary_dim",
        "query_pre_attn_scalar", "layer_types", "nope_layers", "full_d_head", "full_n_kv_heads", "n_kv_shared_layers",
        "double_wide_mlp", "d_vocab_per_layer", "dense_layers"}
    assert all(ours[f] == theirs[f] for f in same)
    model = HookedTransformer(small).eval()
    with torch.no_grad():
        logits = model(torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0)))
    assert logits.shape == (1, 6, 50) and torch.isfinite(logits).all()


def test_replace_keeps_fields_given_explicitly():
    phi3 = PRESETS["phi-3-mini"]
    small = phi3.replace(d_model=64, n_heads=4)  # rotary_dim used to stay 96 > d_head and raise
    assert (small.d_head, small.rope.dim, small.n_kv_heads) == (16, 16, 4)
    given = dict(d_model=64, n_heads=4, n_kv_heads=2, d_head=32, d_mlp=100, rotary_dim=8)
    assert {f: getattr(phi3.replace(**given), f) for f in given} == given
    qwen3 = PRESETS["qwen3-0.6b"]  # d_head 128 is wider than d_model / n_heads: kept while neither changes
    assert qwen3.replace(n_layers=2).d_head == 128 and qwen3.replace(d_mlp=64).d_head == 128
    gemma = PRESETS["gemma-2-2b"]
    assert gemma.replace(d_head=64, query_pre_attn_scalar=100.0).attention.query_pre_attn_scalar == 100.0
    assert gemma.replace(n_layers=3, layer_types=("full",) * 3).layer_types == ("full",) * 3
    assert PRESETS["gpt2"].replace(mlp="swiglu", mlp_bias=True).mlp_bias


def test_replace_keeps_proportions():
    pythia = PRESETS["pythia-160m"]  # rotary over a quarter of each head
    assert pythia.rope.dim == pythia.d_head // 4
    assert pythia.replace(d_model=256, n_heads=4).rope.dim == 16  # d_head 64
    assert pythia.replace(d_head=32).rope.dim == 8
    assert pythia.replace(d_head=4).rope.dim == 2  # the least that rotates, rounded to even
    llama = PRESETS["llama-3.1-8b"]  # 32 heads share 8 kv heads; d_mlp = 3.5 d_model
    assert llama.replace(n_heads=8, d_model=512).n_kv_heads == 2
    assert llama.replace(d_model=512, n_heads=8).d_mlp == 1792
    assert PRESETS["gpt2"].replace(n_heads=4).n_kv_heads == 4  # MHA stays MHA
    with pytest.raises(ValueError, match="7 query heads per kv head.*pass n_kv_heads"):
        PRESETS["qwen2.5-0.5b"].replace(d_model=64, n_heads=4)
    assert PRESETS["qwen2.5-0.5b"].replace(d_model=64, n_heads=4, n_kv_heads=2).n_kv_heads == 2
    gemma3 = PRESETS["gemma-3-1b"]  # 26 blocks, every sixth global: the pattern continues past 26
    assert gemma3.replace(n_layers=36).layer_types == tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(36))
    assert PRESETS["gemma-2-2b"].replace(n_layers=5).layer_types == ("sliding", "full") * 2 + ("sliding",)
    assert PRESETS["gpt2"].replace(mlp="swiglu").mlp_bias is False  # the gated MLP's default
    assert PRESETS["llama-3.2-1b"].replace(mlp="gelu").mlp_bias is True


# ------------------------------------------------------------------ families
def _family_dict(family: str) -> dict:
    from conftest import make_hf_family

    return make_hf_family(family).config.to_dict()


# Every config value lenskit refuses, per family: the error names the field.
REFUSED = [
    ("gpt_neox", {"hidden_act": "silu"}, "hidden_act"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
    ("llama", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "low_freq_factor"),
    ("mistral", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("gemma2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding_attention"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}}, "rope_type"),
    ("gemma3_text", {"rope_parameters": {"chunked_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ("olmo2", {"hidden_act": "gelu"}, "hidden_act"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 2,
                                  "long_factor": [2.0] * 2}}, "rope_type"),
    ("llama", {"model_type": "gemma"}, "model_type"),
    ("llama", {"model_type": None}, "model_type"),
]


@pytest.mark.parametrize("family, change, field", REFUSED, ids=[f"{f}-{k}" for f, _, k in REFUSED])
def test_unimplemented_family_fields_are_refused_by_name(family, change, field):
    d = {**_family_dict(family), **change}
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig.from_hf_config(d)
    assert "\n" not in str(err.value)


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='t5'.*gpt2.*gpt_neox.*llama.*mistral.*qwen2.*qwen3"):
        ModelConfig.from_hf_config({"model_type": "t5"})


BAD_TYPES = [
    ("gpt2", {"n_embd": [192]}, "n_embd"),
    ("gpt2", {"n_layer": 6.7}, "n_layer"),
    ("gpt2", {"n_layer": True}, "n_layer"),
    ("gpt2", {"n_layer": 0}, "n_layer"),
    ("gpt2", {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ("gpt2", {"layer_norm_epsilon": "abc"}, "layer_norm_epsilon"),
    ("gpt2", {"bos_token_id": "0"}, "bos_token_id"),
    ("llama", {"num_key_value_heads": 3}, "n_kv_heads"),
    ("llama", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ("llama", {"head_dim": "64"}, "head_dim"),
    ("gpt_neox", {"use_parallel_residual": 1}, "use_parallel_residual"),
    ("mistral", {"sliding_window": -4}, "sliding_window"),
    ("qwen2", {"attention_dropout": "0"}, "attention_dropout"),
    ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping"),
    ("gemma2", {"query_pre_attn_scalar": float("inf")}, "query_pre_attn_scalar"),
    ("gemma3_text", {"sliding_window_pattern": 0, "layer_types": None}, "sliding_window_pattern"),
    ("phi3", {"sliding_window": 0}, "sliding_window"),
]


@pytest.mark.parametrize("family, change, field", BAD_TYPES, ids=[f"{f}-{k}" for f, _, k in BAD_TYPES])
def test_wrong_types_name_the_field(family, change, field):
    base = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2).to_dict() if family == "gpt2" else _family_dict(family)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config({**base, **change})


def test_direct_construction_is_typed_too():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=5, n_ctx=4, tie_word_embeddings="false")
    with pytest.raises(ValueError, match="rotary_dim"):
        ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=5, n_ctx=4, positional="rotary", rotary_dim=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_layers=1, d_model=8, n_heads=4, n_kv_heads=3, d_vocab=5, n_ctx=4)


def test_family_presets_by_hub_name():
    assert ModelConfig.from_name("EleutherAI/pythia-160m").family == "gpt_neox"
    assert ModelConfig.from_name("meta-llama/Llama-3.2-1B").rope.type == "llama3"
    assert ModelConfig.from_name("Qwen/Qwen3-0.6B").attention.qk_norm
