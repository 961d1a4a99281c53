"""Config fields as transformers reads them: absent fields take transformers' own defaults, nulls mean what they
mean there, the two rotary spellings (4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`) resolve as
transformers 5 resolves them or are refused by name, values outside a field's domain are refused by name and
value, a claimed depth is checked against the checkpoint's tensor names before anything scales with it, and
`lenskit info --model PATH` refuses a path that does not exist (issue 29, items 1 and 13).

The reference is transformers itself, never a number written here: each family's config class built with no
arguments (its defaults), `from_dict` of the same dict (its resolution of absent, null and legacy fields), and
the rotary embedding of the model it builds (its inverse frequencies). Every rule runs on several families.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import math
import re
import time
import tracemalloc

import pytest
import torch
import transformers
from conftest import FAMILIES, FAMILY_CONFIGS, make_hf_family

import lenskit
from lenses.cli import main as cli_main
from lenskit import HookedTransformer, ModelConfig
from lenskit.families import FAMILIES as REGISTRY
from lenskit.families import config_fields
from lenskit.families.fields import MAX_LAYERS
from lenskit.pieces.rotary import inverse_frequencies

# The only fields lenskit requires: the sizes. transformers' defaults for them are one published model's shape
# (Llama 2 7B's 4096 and 32 layers), which a config without them never meant.
REQUIRED = {"model_type", "n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "num_hidden_layers", "hidden_size",
            "num_attention_heads", "intermediate_size", "max_position_embeddings"}


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
    full = hf_config_class(family)().to_dict()
    minimal = {"model_type": family}
    for _ in range(len(REQUIRED)):
        try:
            config_fields(minimal)
            break
        except ValueError as e:
            missing = re.search(r"lacks required field '(\w+)'", str(e))
            assert missing, f"{family}: a config with only some sizes is refused for another reason: {e}"
            minimal[missing.group(1)] = full[missing.group(1)]
    assert set(minimal) <= REQUIRED, f"{family}: lenskit requires {sorted(set(minimal) - REQUIRED)}, which have defaults"
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
                elif variant == "absent" and key not in REQUIRED and not isinstance(theirs, Exception):
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
    if cfg.local_rotary_base is not None:
        return {"full_attention": inverse_frequencies(cfg), "sliding_attention": inverse_frequencies(cfg, local=True)}
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
       ("rope_parameters.rope_theta=1000000.0", "rope_theta=10000.0")) for f in ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")),
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


# ------------------------------------------------------------------ values outside a field's domain
LINEAR = {"rope_type": "linear", "factor": 2.0}
# (family, changes to the tiny config, words the one-line refusal holds: the field and its value)
DOMAIN = [
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, ("rope_parameters.rope_theta=0", "positive")),
    ("qwen2", {"rope_parameters": None, "rope_theta": -1.0}, ("rope_theta=-1.0", "positive")),
    ("gemma2", {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, ("rope_theta=nan", "finite")),
    ("olmo2", {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, ("rope_theta=inf",)),
    ("gpt_neox", {"rope_parameters": None, "rotary_emb_base": 0.0}, ("rotary_emb_base=0.0", "positive")),
    ("gemma3_text", {"rope_parameters": None, "rope_local_base_freq": -10.0}, ("rope_local_base_freq=-10.0",)),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 0}}},
     ("sliding_attention.rope_theta=0",)),
    ("llama", {"rope_parameters": {**LINEAR, "factor": 0}}, ("rope_parameters.factor=0", "positive")),
    ("gemma2", {"rope_parameters": {**LINEAR, "factor": -2.0}}, ("factor=-2.0",)),
    ("gemma3_text", {"rope_parameters": {"full_attention": {**LINEAR, "factor": 0.0}}}, ("full_attention.factor=0.0",)),
    ("mistral", {"rope_parameters": {**LLAMA3, "low_freq_factor": 0}}, ("low_freq_factor=0", "positive")),
    ("llama", {"rope_parameters": {**LLAMA3, "high_freq_factor": -4.0}}, ("high_freq_factor=-4.0",)),
    ("llama", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}}, ("partial_rotary_factor=1.5", "(0, 1]")),
    ("phi3", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0}}, ("partial_rotary_factor=0",)),
    ("gpt_neox", {"rope_parameters": None, "rotary_pct": 0.0}, ("rotary_pct=0.0",)),
    ("gpt_neox", {"rope_parameters": None, "rotary_pct": 2.0}, ("rotary_pct=2.0", "(0, 1]")),
    ("llama", {"rms_norm_eps": 0.0}, ("rms_norm_eps=0.0", "positive")),
    ("olmo2", {"rms_norm_eps": -1e-5}, ("rms_norm_eps=-1e-05",)),
    ("gpt_neox", {"layer_norm_eps": 0}, ("layer_norm_eps=0",)),
    ("gpt2", {"layer_norm_epsilon": -1.0}, ("layer_norm_epsilon=-1.0",)),
    ("gemma2", {"query_pre_attn_scalar": 0}, ("query_pre_attn_scalar=0", "positive")),
    ("gemma3_text", {"query_pre_attn_scalar": -8}, ("query_pre_attn_scalar=-8",)),
    ("gemma2", {"attn_logit_softcapping": 0.0}, ("attn_logit_softcapping=0.0", "positive")),
    ("gemma3_text", {"final_logit_softcapping": -1.0}, ("final_logit_softcapping=-1.0",)),
    ("mistral", {"sliding_window": 0}, ("sliding_window=0", "positive integer")),
    ("phi3", {"sliding_window": -6}, ("sliding_window=-6",)),
    ("gemma2", {"sliding_window": None}, ("sliding_window=None", "sliding-window blocks")),
    ("llama", {"num_key_value_heads": 3}, ("num_key_value_heads=3", "num_attention_heads=4")),
    ("gemma2", {"num_key_value_heads": 3}, ("num_key_value_heads=3", "must divide")),
    ("qwen3", {"num_key_value_heads": 0}, ("num_key_value_heads=0",)),
    ("llama", {"rms_norm_eps": None}, ("rms_norm_eps=None", "not null")),
    ("gemma2", {"tie_word_embeddings": None}, ("tie_word_embeddings=None", "not null")),
    ("gpt2", {"n_head": None}, ("n_head=None",)),
    ("qwen3", {"head_dim": None}, ("head_dim=None", "not null")),
]


@pytest.mark.parametrize("family, changes, words", DOMAIN, ids=[f"{f}-{'-'.join(c)}" for f, c, _ in DOMAIN])
def test_values_outside_a_fields_domain_are_refused_by_name_and_value(family, changes, words):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(tiny_dict(family, **changes))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_a_defaulted_kv_head_count_that_does_not_divide_says_it_was_the_default(family):
    """Without num_key_value_heads, Mistral has 8, Qwen 2 32 and Gemma 2 4 (transformers' defaults, not n_heads):
    over 6 query heads none divides, and the error says where the number came from."""
    d = {k: v for k, v in tiny_dict(family, num_attention_heads=6, hidden_size=48).items() if k != "num_key_value_heads"}
    with pytest.raises(ValueError, match=r"num_key_value_heads=\d+ \(transformers' default for an absent field\) must "
                                         r"divide num_attention_heads=6"):
        ModelConfig.from_hf_config(d)


def test_the_domain_table_tests_each_rule_on_several_families():
    rules = {"rope_theta": ("rope_theta", "rotary_emb_base", "rope_local_base_freq"), "factor": ("factor",),
             "eps": ("eps", "epsilon"), "heads": ("num_key_value_heads",), "window": ("sliding_window",),
             "fraction": ("partial_rotary_factor", "rotary_pct"), "null": ("None",)}
    for rule, spellings in rules.items():
        families = {f for f, _, words in DOMAIN if any(s in w for w in words for s in spellings)}
        assert len(families) >= 2, (rule, families)


@pytest.mark.parametrize("field, value", [("rotary_base", 0.0), ("rotary_base", -1.0), ("rope_factor", 0.0),
                                          ("rope_low_freq_factor", float("nan")), ("rope_high_freq_factor", float("inf"))])
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen3-0.6b"])
def test_model_config_itself_refuses_rotary_values_transformers_turns_into_nan(preset, field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field} must be a positive finite number, got {value!r}"):
        lenskit.PRESETS[preset].replace(**{field: value})


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_must_divide_d_model_exactly_where_transformers_requires_it(family):
    """hidden_size 34 over 4 heads of 8 dims: transformers refuses it for GPT-2, GPT-NeoX, Llama and Gemma and runs
    it for the others; lenskit refuses the same ones, naming both fields."""
    names = {"gpt2": ("n_embd", "n_head")}.get(family, ("hidden_size", "num_attention_heads"))
    d = tiny_dict(family, **{names[0]: 34, names[1]: 4})
    if "head_dim" in d or family in ("qwen2", "olmo2"):
        d["head_dim"] = 8
    if "num_key_value_heads" in d:
        d["num_key_value_heads"] = 2
    try:  # built and run: OLMoE builds with a q norm of hidden_size features but fails in its forward
        hf_cfg = hf_config_class(family).from_dict(copy.deepcopy(d), experts_implementation="eager")
        getattr(transformers, FAMILY_CONFIGS[family][1])(hf_cfg).eval()(torch.tensor([[1, 2]]))
        accepted = True
    except Exception:  # noqa: BLE001 - transformers' validation errors are not all ValueErrors
        accepted = False
    ours = read(d)
    if accepted:
        assert isinstance(ours, ModelConfig) and ours.d_head == 8, ours
    else:
        assert isinstance(ours, ValueError) and f"{names[0]}=34" in str(ours) and f"{names[1]}=4" in str(ours), ours


def test_heads_rule_is_tested_both_ways():
    """The parity test above is not vacuous: some families refuse the shape and the others read it."""
    def refused(family: str) -> bool:
        names = ("n_embd", "n_head") if family == "gpt2" else ("hidden_size", "num_attention_heads")
        return isinstance(read(tiny_dict(family, **{names[0]: 34, names[1]: 4})), ValueError)

    assert {f for f in FAMILIES if refused(f)} == {"gpt2", "gpt_neox", "llama", "gemma2", "gemma3_text", "olmoe"}


# ------------------------------------------------------------------ absurd depth, checked against the checkpoint
def write_checkpoint(family: str, folder):
    """The family's 3-block tiny model saved in its Hugging Face layout; its config.json."""
    make_hf_family(family, seed=1, **REGISTRY[family].tiny_3_blocks).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("family, drop", [("gpt2", ()), ("llama", ()), ("gemma2", ("layer_types",)),
                                          ("gemma3_text", ("layer_types",))])
@pytest.mark.parametrize("n_layers", [10**6, 10**9])
def test_a_config_claiming_absurd_depth_is_refused_at_once(family, drop, n_layers, tmp_path):
    """A few hundred bytes claiming a million or a billion blocks over a 3-block checkpoint: refused in well under a
    second, with no allocation that scales with the claim (Gemma's per-block layer types are not even derived)."""
    config = write_checkpoint(family, tmp_path)
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    config = {k: v for k, v in config.items() if k not in drop} | {key: n_layers}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ValueError) as err:
            HookedTransformer.from_pretrained(tmp_path)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert f"{key}={n_layers}" in message and "hold 3 block(s)" in message and "missing" in message, message
    assert elapsed < 0.5, f"refused after {elapsed:.2f} s"
    assert peak < 20e6, f"{peak / 1e6:.0f} MB allocated before the refusal"


@pytest.mark.parametrize("family, extra", [("gpt2", "h.2.attn.c_attn.bias"), ("qwen2", "layers.2.input_layernorm.weight")])
def test_fewer_layers_than_the_checkpoint_holds_names_the_tensors_left_over(family, extra, tmp_path):
    config = write_checkpoint(family, tmp_path)
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    (tmp_path / "config.json").write_text(json.dumps({**config, key: 2}))
    with pytest.raises(ValueError, match=rf"model with n_layers=2 does not: \[.*'{re.escape(extra)}'"):
        HookedTransformer.from_pretrained(tmp_path)


def test_the_depth_check_counts_distinct_blocks_so_a_huge_index_cannot_pass(tmp_path):
    """One stray tensor named for block 999999999 does not make the checkpoint a billion blocks deep."""
    layout = REGISTRY["llama"].layout
    names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "layers.1.mlp.up_proj.weight",
             "model.layers.999999999.mlp.up_proj.weight", "lm_head.weight"]
    assert layout.block_count(names) == 3
    assert ModelConfig.from_hf_config(tiny_dict("llama", num_hidden_layers=3), tensor_names=names).n_layers == 3
    d = tiny_dict("llama", num_hidden_layers=10**9)
    with pytest.raises(ValueError, match="hold 3 block"):
        ModelConfig.from_hf_config(d, tensor_names=names)


def run_info(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["info", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_info_refuses_an_absurd_depth_over_a_checkpoint_and_counts_one_without_quickly(family, tmp_path):
    config = write_checkpoint(family, tmp_path / "with_weights")
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    config = {k: v for k, v in config.items() if k != "layer_types"} | {key: 10**9}
    (tmp_path / "with_weights" / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    code, _, err = run_info("--model", str(tmp_path / "with_weights"))
    assert code == 2 and f"{key}=1000000000 does not match the checkpoint" in err and len(err.strip().splitlines()) == 1
    assert time.perf_counter() - start < 1.0
    # Without weights there is nothing to contradict: a depth within the stated bound is counted at once, from the
    # claimed shape; beyond it the claim is refused by name, before any per-block table (Gemma's layer types) is built.
    (tmp_path / "config_only").mkdir()
    claimed = tmp_path / "config_only" / "config.json"
    claimed.write_text(json.dumps({**config, key: MAX_LAYERS}))
    start = time.perf_counter()
    code, out, err = run_info("--model", str(tmp_path / "config_only"))
    assert code == 0, err
    assert f"n_layers={MAX_LAYERS} " in out and time.perf_counter() - start < 2.0
    per_block = lenskit.accounting.param_summary(ModelConfig.from_hf_config(config | {key: 1}))
    total = int(per_block.loc["total", "value"]) + (MAX_LAYERS - 1) * int(per_block.loc["per_block", "value"])
    assert f"{total:,}" in out
    for n_layers in (MAX_LAYERS + 1, 10**9):
        claimed.write_text(json.dumps({**config, key: n_layers}))
        start = time.perf_counter()
        code, out, err = run_info("--model", str(tmp_path / "config_only"))
        assert code == 2 and f"{key}={n_layers} is beyond lenskit's bound of {MAX_LAYERS:,} blocks" in err, err
        assert len(err.strip().splitlines()) == 1 and time.perf_counter() - start < 1.0


# ------------------------------------------------------------------ info --model PATH (item 13)
@pytest.mark.parametrize("path", ["../../gpt2", "./gpt2", "gpt2/", "nowhere/else/gpt2", "~/lenskit-no-such-folder/gpt2",
                                  "/lenskit-no-such-folder/pythia-160m", "..\\gpt2"])
def test_info_on_a_path_that_does_not_exist_says_so(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    code, out, err = run_info("--model", path)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert path in err and ("no folder" in err or "not a local folder" in err), err


@pytest.mark.parametrize("name", ["gpt2", "GPT2", "openai-community/gpt2", "EleutherAI/pythia-160m", "qwen3-0.6b"])
def test_info_still_reads_presets_named_exactly(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_info("--model", name)
    assert code == 0 and "from preset shapes" in out
    assert f"family={ModelConfig.from_name(name).family} " in out


def test_info_on_an_unknown_name_not_in_the_hub_cache_says_so_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    code, out, err = run_info("--model", "gpt5")
    assert code == 2 and out == "" and "'gpt5' is not a local folder, and not in the local Hugging Face cache" in err


@pytest.mark.parametrize("name", ["../../gpt2", "./gpt2", "/gpt2", "a/b/gpt2", "~/gpt2", ".org/gpt2"])
def test_a_path_is_never_read_as_the_preset_it_ends_in(name):
    with pytest.raises(KeyError, match="no preset named"):
        ModelConfig.from_name(name)
    assert ModelConfig.from_name("openai-community/gpt2") == ModelConfig.from_name("gpt2")
    assert math.isfinite(ModelConfig.from_name("EleutherAI/pythia-160m").rotary_base)
