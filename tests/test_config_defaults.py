"""Config fields as transformers reads them: absent fields take transformers' own defaults, nulls mean what they
mean there, the two rotary spellings (4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`) resolve as
transformers 5 resolves them or are refused by name, values outside a field's domain are refused by name and
(issue 29, item 1). Values outside a field's domain, a claimed depth and `lenskit info --model PATH`:
tests/test_config_bounds.py.

The reference is transformers itself, never a number written here: each family's config class built with no
arguments (its defaults), `from_dict` of the same dict (its resolution of absent, null and legacy fields), and
the rotary embedding of the model it builds (its inverse frequencies). Every rule runs on several families.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch
import transformers
from conftest import FAMILIES, FAMILY_CONFIGS, make_hf_family

from lenskit import HookedTransformer, ModelConfig
from lenskit.families import FAMILIES as REGISTRY
from lenskit.families import config_fields
from lenskit.pieces.rotary import inverse_frequencies

# The only fields lenskit requires: the sizes. transformers' defaults for them are one published model's shape
# (Llama 2 7B's 4096 and 32 layers), which a config without them never meant.
REQUIRED = {"model_type", "n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "num_hidden_layers", "hidden_size",
            "num_attention_heads", "intermediate_size", "max_position_embeddings"}


# Fields whose transformers default turns on a piece lenskit refuses by name, or gives a shape it refuses: their
# absence is refused, and the no-argument config is compared with them set on both sides. Gemma 4's per-layer inputs
# (on by default at 256) and Nemotron-H's MoE layer in its default layers are implemented. GLM-4.5's class has no
# head_dim, so its defaults derive 4096 // 96 = 42 and rotate an odd 21 features: refused, and compared at 128.
DEFAULT_REFUSED: dict[str, dict] = {"glm4_moe": {"head_dim": 128}}


def hf_config_class(family: str) -> type:
    return getattr(transformers, FAMILY_CONFIGS[family][0])


def tiny_dict(family: str, **changes) -> dict:
    """The config.json transformers writes for the family's tiny test model, with `changes`."""
    return {**hf_config_class(family)(**FAMILY_CONFIGS[family][2]).to_dict(), **changes}


def hf_resolved(family: str, d: dict) -> dict | Exception:
    """The config.json transformers 5 writes after reading `d`: every default, derivation and legacy spelling
    resolved its way. The exception, where transformers refuses `d`."""
    try:
        return hf_config_class(family).from_dict(copy.deepcopy(d)).to_dict()
    except Exception as e:  # noqa: BLE001 - any refusal by transformers counts
        return e


def read(d: dict) -> ModelConfig | ValueError:
    try:
        return ModelConfig.from_hf_config(copy.deepcopy(d))
    except ValueError as e:
        return e


def differences(ours: ModelConfig, theirs: ModelConfig) -> dict:
    return {f.name: (getattr(ours, f.name), getattr(theirs, f.name)) for f in dataclasses.fields(ModelConfig)
            if getattr(ours, f.name) != getattr(theirs, f.name)}


class Recorder(dict):
    """A config dict that records which top-level fields the reader looks at."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: set[str] = set()

    def __contains__(self, key) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)


def fields_read(d: dict) -> set[str]:
    recorder = Recorder(copy.deepcopy(d))
    config_fields(recorder)
    return recorder.seen


# ------------------------------------------------------------------ absent fields: transformers' defaults
@pytest.mark.parametrize("family", FAMILIES)
def test_absent_fields_take_the_defaults_of_transformers_config_class(family):
    """A config.json holding only the sizes reads as the config transformers builds with no arguments at all."""
    off = DEFAULT_REFUSED.get(family, {})
    full = hf_config_class(family)(**off).to_dict()
    minimal = {"model_type": family, **off}
    for _ in range(len(REQUIRED)):
        try:
            config_fields(minimal)
            break
        except ValueError as e:
            missing = re.search(r"lacks required field '(\w+)'", str(e))
            assert missing, f"{family}: a config with only some sizes is refused for another reason: {e}"
            minimal[missing.group(1)] = full[missing.group(1)]
    assert set(minimal) <= REQUIRED | set(off), f"{family}: lenskit requires {sorted(set(minimal) - REQUIRED)}, which have defaults"
    assert len(minimal) >= 5  # the test compared something: the sizes are required, everything else defaulted
    diff = differences(ModelConfig.from_hf_config(minimal), ModelConfig.from_hf_config(full))
    assert not diff, f"{family}: absent fields read as (lenskit, transformers' default): {diff}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_field_absent_or_null_reads_as_transformers_reads_it(family):
    """Every field lenskit reads, dropped from (or set to null in) the tiny model's config.json one at a time:
    lenskit's reading equals its reading of what transformers 5 resolves that file to, or it is refused by name.
    A drop is refused only for a size; a file transformers refuses, lenskit refuses too."""
    base = tiny_dict(family)
    keys = sorted(fields_read(base) & set(base) - {"model_type"})
    assert len(keys) >= 10, keys  # the reader was seen reading the family's fields
    wrong = []
    for key in keys:
        for variant in ("absent", "null"):
            d = {k: v for k, v in base.items() if k != key} if variant == "absent" else {**base, key: None}
            resolved = hf_resolved(family, d)
            ours = read(d)
            theirs = resolved if isinstance(resolved, Exception) else read(resolved)
            where = f"{key} {variant}"
            if isinstance(ours, ValueError):
                if key not in str(ours) or "\n" in str(ours):
                    wrong.append(f"{where}: refused without naming the field in one line: {ours}")
                elif (variant == "absent" and key not in REQUIRED and key not in DEFAULT_REFUSED.get(family, {})
                      and not isinstance(theirs, Exception)):
                    wrong.append(f"{where}: refused ({ours}), but transformers has a default")
            elif isinstance(theirs, Exception):
                wrong.append(f"{where}: transformers refuses it ({type(theirs).__name__}), lenskit loads it")
            elif differences(ours, theirs):
                wrong.append(f"{where}: (lenskit, transformers) {differences(ours, theirs)}")
    assert not wrong, f"{family}:\n" + "\n".join(wrong)


# The field, the value the tiny model is saved with (unlike transformers' default), and how each side names it.
END_TO_END = {
    ("olmo2", "rms_norm_eps"): (1e-2, "norm_eps", lambda c: c.rms_norm_eps),
    ("phi3", "rms_norm_eps"): (1e-2, "norm_eps", lambda c: c.rms_norm_eps),
    ("mistral", "sliding_window"): (5, "sliding_window", lambda c: c.sliding_window),
    ("gemma2", "final_logit_softcapping"): (2.0, "final_softcap", lambda c: c.final_logit_softcapping),
    ("llama", "rope_parameters"): (None, "rotary_base", lambda c: c.rope_parameters["rope_theta"]),
}


@pytest.mark.parametrize("family, key", list(END_TO_END), ids=[f"{f}-{k}" for f, k in END_TO_END])
def test_a_checkpoint_without_the_field_computes_what_transformers_computes(family, key, tmp_path):
    """The issue's cases end to end: the folder's config.json lacks the field; lenskit and transformers load the
    same folder, and their logits agree (OLMo 2 and Phi-3 were off by up to 0.37 with lenskit's old eps)."""
    saved, field, theirs_of = END_TO_END[family, key]
    hf = make_hf_family(family, seed=5, **({key: saved} if saved is not None else {}))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = getattr(transformers, FAMILY_CONFIGS[family][1]).from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = HookedTransformer.from_pretrained(tmp_path)
    # transformers' default, which differs from the value the file was saved with
    assert getattr(ours.cfg, field) == theirs_of(theirs.config) != getattr(HookedTransformer.from_hf(hf).cfg, field)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-4)


# ------------------------------------------------------------------ rotary: both spellings
def hf_inverse_frequencies(family: str, d: dict) -> dict[str, torch.Tensor]:
    """The inverse frequencies of the rotary embedding transformers builds from `d` (by layer type for Gemma 3)."""
    hf_cfg = hf_config_class(family).from_dict(copy.deepcopy(d))
    model = getattr(transformers, FAMILY_CONFIGS[family][1])(hf_cfg)
    found = {name.rsplit(".", 1)[-1].removesuffix("inv_freq").rstrip("_") or "inv_freq": buffer
             for name, buffer in model.named_buffers() if name.endswith("inv_freq") and "original" not in name}
    scales = [v for m in model.modules() for k, v in vars(m).items() if k.endswith("attention_scaling")]
    assert scales and all(s == 1.0 for s in scales)  # lenskit implements no attention rescaling
    return found


def our_inverse_frequencies(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    if cfg.rope.local_base is not None:
        return {"full_attention": inverse_frequencies(cfg, dim=cfg.attention.full_d_head),  # Gemma 4's full heads are wider
                "sliding_attention": inverse_frequencies(cfg, local=True)}
    return {"inv_freq": inverse_frequencies(cfg)}


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# (family, rotary fields, None: resolved as transformers resolves them; else words the refusal names)
ROPE = [
    # 4.x spellings
    ("llama", {"rope_theta": 5e5}, None),
    ("qwen2", {"rope_theta": 1e6, "rope_scaling": None}, None),
    ("llama", {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}, None),
    ("gemma2", {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, None),
    ("mistral", {"rope_theta": 1e6, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 16}}, None),
    ("gpt_neox", {"rotary_emb_base": 5e5, "rotary_pct": 0.5}, None),
    ("gemma3_text", {"rope_theta": 5e5, "rope_local_base_freq": 100.0}, None),
    ("gemma3_text", {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, None),
    # 5.x spellings, and fields transformers 5 fills in
    ("olmo2", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, None),
    ("llama", {"rope_parameters": LLAMA3}, None),  # original_max_position_embeddings from max_position_embeddings
    ("qwen3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 2e5}, None),
    ("phi3", {"rope_parameters": {"rope_type": "default"}, "partial_rotary_factor": 0.5}, None),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default"}, "rotary_emb_base": 2e5}, None),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default"}}, "rope_theta": 5e5}, None),
    ("mixtral", {}, None),  # no rotary field at all: Mixtral's own base, 1e6, not the 1e4 of the others
    ("mixtral", {"rope_parameters": {"rope_type": "default"}}, None),
    ("mixtral", {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}, None),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 2e5}, None),
    ("olmoe", {"rope_theta": 5e5}, None),
    ("gpt_oss", {"rope_parameters": {"rope_type": "default"}, "rope_theta": 2e5}, None),  # gpt-oss's default is YaRN
    ("gpt_oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, None),
    ("olmo3", {"rope_theta": 5e5}, None),  # the sliding blocks' own default base, so transformers 4 and 5 agree
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}, None),
    ("olmo3", {"rope_theta": 1e4, "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     None),
    ("olmo3", {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),  # the full blocks only
    ("smollm3", {}, None),  # SmolLM3's own base, 2e6
    # Qwen 3.5: a quarter of each head rotates by default; the mrope sections are typed, and moot for text positions
    ("qwen3_5_text", {}, None),
    ("qwen3_5_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}}, None),
    ("qwen3_5_text", {"rope_theta": 5e5, "partial_rotary_factor": 0.5}, None),
    ("smollm3", {"rope_theta": 5e6}, None),
    # Qwen3-Next: as Qwen 3.5, a quarter of each head rotating by default; its published config's top-level spelling
    ("qwen3_next", {}, None),
    ("qwen3_next", {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_scaling": None}, None),
    ("qwen3_next", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 1e4},
     ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")),
    # DeepSeek V3: rotary over qk_rope_head_dim; Kimi K2's 4.x YaRN (mscale over mscale_all_dim: attention factor 1)
    ("deepseek_v3", {"rope_theta": 5e4, "rope_scaling": {"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                         "original_max_position_embeddings": 16, "beta_fast": 1.0,
                                                         "beta_slow": 1.0}}, None),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, None),
    # Gemma 4: per layer type, proportional rotary (a share of the full blocks' wider heads turning) by default
    ("gemma4_text", {}, None),
    ("gemma4_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                            "rope_theta": 1e4, "factor": 2.0}}}, None),
    ("gemma4_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, None),
    # Apertus: with no rotary field, its config class's Llama 3 scaling at base 1.2e7
    ("apertus", {}, None),
    ("apertus", {"rope_theta": 5e5}, ("rope_parameters.rope_theta=12000000.0", "rope_theta=500000.0", "disagree")),  # 5 ignores it
    ("apertus", {"rope_theta": 1.2e7, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 16}}, None),
    ("apertus", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, None),
    # Llama 4: its own base, 5e5; Scout's 4.x spelling of Llama 3's scaling
    ("llama4_text", {}, None),
    ("llama4_text", {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 1.0, "original_max_position_embeddings": 16}},
     None),
    # GLM-4.5: half of each head rotates by default; the published 4.x spelling; a whole rotation; linear scaling
    ("glm4_moe", {}, None),
    ("glm4_moe", {"rope_theta": 1e6, "partial_rotary_factor": 0.5}, None),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}, None),
    ("glm4_moe", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 2e5}, None),
    # Falcon-H1: every feature of a head rotates; the published configs' base 1e11 in 4.x's top-level spelling
    ("falcon_h1", {}, None),
    ("falcon_h1", {"rope_theta": 1e11, "rope_scaling": None}, None),
    # both spellings, agreeing
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 5e5}, None),
    ("gemma2", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                  "rotary_pct": 0.5, "rope_theta": 1e4}, None),
    # both spellings, disagreeing: transformers 4 and 5 would compute different functions
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5},
     ("rope_parameters.rope_theta=10000.0", "rope_theta=500000.0", "disagree")),
    ("olmo2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5},
     ("rope_parameters.rope_theta", "rope_theta=500000.0")),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 1e4},
     ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")),
    *((f, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 1e4},
       ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")) for f in ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3",
                                                                        "glm4_moe", "falcon_h1")),
    ("apertus", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 1e4},
     ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")),
    ("llama4_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 5e5},
     ("rope_parameters.rope_theta=1000000.0", "rope_theta=500000.0")),
    ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"type": "linear", "factor": 2.0}},
     ("rope_scaling", "rope_parameters", "disagree")),
    ("mistral", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}, "rope_scaling": {"type": "linear", "factor": 2.0}},
     ("rope_scaling", "rope_parameters", "rope_factor: 2.0 vs 4.0")),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_theta": 5e5},
     ("rope_scaling.rope_theta=10000.0", "rope_theta=500000.0")),
    ("phi3", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor": 0.75},
     ("partial_rotary_factor=0.5", "partial_rotary_factor=0.75")),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rotary_emb_base": 5e5},
     ("rope_parameters.rope_theta=10000.0", "rotary_emb_base=500000.0")),
    ("gpt_neox", {"rotary_emb_base": 1e4, "rope_theta": 5e5}, ("rope_theta=500000.0", "not read by transformers 5")),
    ("gpt_neox", {"rotary_pct": 0.5, "partial_rotary_factor": 1.0}, ("partial_rotary_factor=1.0", "not read")),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta": 5.0},
     ("rope_parameters.full_attention.rope_theta=1000000.0", "rope_theta=5.0")),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                     "rope_local_base_freq": 100.0}, ("sliding_attention.rope_theta=10000.0", "rope_local_base_freq=100.0")),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ("rope_scaling", "full_attention", "disagree")),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta": 1e4},
     ("rope_parameters.full_attention.rope_theta=1000000.0", "rope_theta=10000.0")),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ("rope_scaling", "full_attention", "disagree")),
    # transformers 5 gives a top-level base to OLMo 3's full blocks only, transformers 4 to every block
    ("olmo3", {"rope_theta": 1e4}, ("rope_theta=10000.0", "sliding_attention")),
    ("olmo3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ("rope_parameters", "full_attention")),
    ("olmo3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     ("sliding_attention", "'linear'")),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}}},
     ("full_attention.partial_rotary_factor=0.5",)),
    ("smollm3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 1e4},
     ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")),
    ("qwen3_5_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [11, 11, 10]},
                      "rope_theta": 1e4}, ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")),
    ("gemma4_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}},
                     "rope_theta": 5e5}, ("rope_theta",)),  # transformers 5 reads Gemma 4's bases per layer type only
    ("gemma4_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}},
     ("sliding_attention", "'linear'")),
    ("gemma4_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                                            "partial_rotary_factor": 0.5}}},
     ("full_attention.partial_rotary_factor", "proportional")),
    # Granite 4: rotary positions only under position_embedding_type "rope" (the tiny model's are "nope")
    ("granitemoehybrid", {"position_embedding_type": "rope", "rope_theta": 5e5}, None),
    ("granitemoehybrid", {"position_embedding_type": "rope", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     None),
    ("granitemoehybrid", {"position_embedding_type": "rope", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                          "rope_theta": 1e4}, ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")),
    # what transformers 5 refuses for the family
    ("phi3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, ("rope_type='linear'", "phi3")),
]


def rope_dict(family: str, fields: dict) -> dict:
    """The tiny config with its rotary fields replaced by `fields`."""
    base = {k: v for k, v in tiny_dict(family).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return {**base, **copy.deepcopy(fields)}


@pytest.mark.parametrize("family, fields, refused", ROPE, ids=[f"{f}-{'-'.join(x)}" for f, x, _ in ROPE])
def test_rotary_fields_resolve_as_transformers_5_or_are_refused_by_name(family, fields, refused):
    d = rope_dict(family, fields)
    if refused is not None:
        with pytest.raises(ValueError) as err:
            ModelConfig.from_hf_config(d)
        message = str(err.value)
        assert "\n" not in message and all(w in message for w in refused), message
        return
    cfg = ModelConfig.from_hf_config(d)
    theirs = hf_inverse_frequencies(family, d)
    ours = our_inverse_frequencies(cfg)
    assert set(ours) == set(theirs)
    for kind in ours:
        assert torch.allclose(ours[kind], theirs[kind].float(), rtol=1e-6, atol=0), (kind, ours[kind], theirs[kind])
    assert cfg == ModelConfig.from_hf_config(hf_resolved(family, d))  # and the 5.x file transformers would write


def test_the_rotary_table_covers_every_rotary_family_both_ways():
    rotary = {t for t in FAMILIES if REGISTRY[t].presets and next(iter(REGISTRY[t].presets.values())).positional == "rotary"}
    resolved = {f for f, _, refused in ROPE if refused is None}
    contradicted = {f for f, fields, refused in ROPE if refused is not None and len(fields) >= 2}
    assert rotary <= resolved and rotary <= contradicted
