"""YaRN rotary scaling: frequencies, attention factor and rotation against transformers; its config.json fields."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lenskit import ModelConfig
from lenskit.families.fields import ConfigReader
from lenskit.families.rope import rope
from lenskit.pieces.rotary import Rotary, attention_factor, inverse_frequencies

GPT_OSS = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
               original_max_position_embeddings=4096)  # openai/gpt-oss-20b's and -120b's config.json
CASES = {
    "gpt-oss": (64, GPT_OSS),
    "truncated": (64, {**GPT_OSS, "truncate": True}),
    "defaults": (128, dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768)),
    "betas": (32, dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=16.0, beta_slow=2.0,
                       original_max_position_embeddings=2048)),
    "attention_factor": (64, {**GPT_OSS, "attention_factor": 0.75}),
    "mscale": (64, dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                        original_max_position_embeddings=4096)),
    "null_factor": (64, dict(rope_type="yarn", rope_theta=10000.0, factor=None, original_max_position_embeddings=8192)),
    "factor_below_one": (16, dict(rope_type="yarn", rope_theta=500.0, factor=0.5, original_max_position_embeddings=64)),
    "partial": (64, {**GPT_OSS, "partial_rotary_factor": 0.5}),
    "whole_band": (8, dict(rope_type="yarn", rope_theta=10.0, factor=2.0, original_max_position_embeddings=16)),
}
MAX_POS = 131072
DEFAULT_YARN = {k: v for k, v in GPT_OSS.items() if k != "rope_theta"}  # GptOssConfig's, for absent rope settings


def read(params, head_dim: int = 64, **top) -> dict:
    d = {"rope_parameters": params, "max_position_embeddings": MAX_POS, **top}
    return rope(ConfigReader(d, "gpt_oss"), head_dim, types=("default", "yarn"), default_theta=150000.0,
                default_params=DEFAULT_YARN)


def configs(head_dim: int, params: dict):
    hf = transformers.GptOssConfig(head_dim=head_dim, hidden_size=head_dim * 4, num_attention_heads=4, num_hidden_layers=2,
                                   max_position_embeddings=MAX_POS, rope_parameters=dict(params))
    ours = ModelConfig(n_layers=2, d_model=head_dim * 4, n_heads=4, d_vocab=10, n_ctx=64, **read(dict(params), head_dim))
    return hf, ours


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_attention_factor_equal_transformers(case):
    head_dim, params = CASES[case]
    hf, ours = configs(head_dim, params)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got = inverse_frequencies(ours)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert attention_factor(ours) == want_factor


def test_yarn_rescales_some_frequencies_and_keeps_others():
    _, ours = configs(*CASES["gpt-oss"])
    yarn, plain = inverse_frequencies(ours), inverse_frequencies(ours.replace(rope_type="default", rope_attention_factor=None))
    assert yarn[0] == plain[0]  # the fastest pair keeps its speed
    torch.testing.assert_close(yarn[-1], plain[-1] / 32, atol=0, rtol=1e-6)  # the slowest is divided by the factor
    assert attention_factor(ours) == pytest.approx(0.1 * math.log(32) + 1)


@pytest.mark.parametrize("case", ["gpt-oss", "partial", "attention_factor"])
def test_rotation_equals_transformers(case):
    """cos and sin scaled by the attention factor, and gpt-oss's half-split rotation (`_apply_rotary_emb`), over q."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf_mod

    head_dim, params = CASES[case]
    hf, ours = configs(head_dim, params)
    positions = torch.arange(50)[None]
    x = torch.randn(1, 50, 3, head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = hf_mod.GptOssRotaryEmbedding(hf)(x, positions)  # [1, pos, rotary_dim / 2]
    rot = ours.rotary_dim
    q = x.transpose(1, 2)  # [1, head, pos, d_head], as transformers holds it
    want = torch.cat([hf_mod._apply_rotary_emb(q[..., :rot], cos[:, None], sin[:, None]), q[..., rot:]], dim=-1)
    rotary = Rotary(ours)
    our_cos, our_sin = rotary.tables(50, x)
    torch.testing.assert_close(our_cos, torch.cat([cos[0], cos[0]], -1), atol=0, rtol=0)
    torch.testing.assert_close(our_sin, torch.cat([sin[0], sin[0]], -1), atol=0, rtol=0)
    torch.testing.assert_close(rotary(x), want.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_local_blocks_with_their_own_base_stay_unscaled():
    _, ours = configs(*CASES["gpt-oss"])
    gemma_like = ours.replace(local_rotary_base=10000.0)
    assert attention_factor(gemma_like, local=True) == 1.0 and attention_factor(ours, local=True) != 1.0


# ------------------------------------------------------------------ config.json
def test_reading_fills_transformers_defaults():
    assert read(None) == read(dict(GPT_OSS))  # no rope_parameters: gpt-oss's own YaRN, as GptOssConfig fills it
    only_theta = transformers.GptOssConfig(rope_theta=1e4).rope_parameters
    assert only_theta["rope_type"] == "yarn" and read(None, rope_theta=1e4) == read(only_theta)  # the base from the top
    got = read({"rope_type": "yarn", "factor": 4.0})
    assert got["rotary_base"] == 150000.0 and got["rope_original_n_ctx"] == MAX_POS
    assert (got["rope_beta_fast"], got["rope_beta_slow"], got["rope_truncate"]) == (32.0, 1.0, True)
    assert got["rope_attention_factor"] is None
    assert read({"rope_type": "yarn", "factor": 4.0, "beta_fast": None})["rope_beta_fast"] == 32.0
    assert read({**GPT_OSS, "factor": None})["rope_factor"] == MAX_POS / 4096


def test_official_config_spelling_reads_as_transformers_reads_it():
    """openai/gpt-oss-*'s config.json spells the settings transformers 4's way: `rope_scaling` and a top-level theta."""
    official = {"rope_theta": 150000, "max_position_embeddings": MAX_POS, "head_dim": 64, "hidden_size": 256,
                "num_attention_heads": 4, "num_hidden_layers": 2,
                "rope_scaling": {k: v for k, v in GPT_OSS.items() if k != "rope_theta"}}
    got = rope(ConfigReader(official, "gpt_oss"), 64, types=("default", "yarn"), default_theta=150000.0,
               default_params=DEFAULT_YARN)
    hf = transformers.GptOssConfig(**official)
    assert got == read(dict(GPT_OSS)) and hf.rope_parameters == GPT_OSS
    ours = ModelConfig(n_layers=2, d_model=256, n_heads=4, d_vocab=10, n_ctx=64, **got)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(inverse_frequencies(ours), want, atol=0, rtol=0)
    assert attention_factor(ours) == want_factor


@pytest.mark.parametrize("change, field", [
    ({"factor": 0}, "factor"),
    ({"factor": -2.0}, "factor"),
    ({"beta_fast": 1.0, "beta_slow": 2.0}, "beta_fast"),
    ({"beta_fast": 0}, "beta_fast"),
    ({"beta_slow": -1.0}, "beta_slow"),
    ({"truncate": "no"}, "truncate"),
    ({"attention_factor": 0.0}, "attention_factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"mscale": -20.0, "mscale_all_dim": 1.0}, "mscale"),
    ({"extrapolation_factor": 1.0}, "extrapolation_factor"),
])
def test_out_of_domain_settings_are_refused_by_name(change, field):
    with pytest.raises(ValueError, match=field) as info:
        read({**GPT_OSS, **change})
    assert "\n" not in str(info.value)


def test_families_without_yarn_still_refuse_it():
    with pytest.raises(ValueError, match="rope_type"):
        rope(ConfigReader({"rope_parameters": dict(GPT_OSS), "max_position_embeddings": MAX_POS}, "llama"), 64)


@pytest.mark.parametrize("change, field", [
    (dict(rope_beta_fast=1.0, rope_beta_slow=4.0), "rope_beta_fast"),
    (dict(rope_beta_slow=0.0), "rope_beta_slow"),
    (dict(rope_original_n_ctx=None), "rope_original_n_ctx"),
    (dict(rope_attention_factor=-1.0), "rope_attention_factor"),
    (dict(rope_type="llama3", rope_attention_factor=1.2), "rope_attention_factor"),
    (dict(rope_truncate=None), "rope_truncate"),
])
def test_model_config_refuses_bad_yarn_fields(change, field):
    _, ours = configs(*CASES["gpt-oss"])
    with pytest.raises(ValueError, match=field):
        ours.replace(**change)
