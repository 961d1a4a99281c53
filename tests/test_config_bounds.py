"""Values outside a field's domain are refused by name and value, on several families each. A config's claimed depth is checked against the checkpoint's tensor names before anything scales with it, and is
bounded where there is no checkpoint; `lenskit info --model PATH` refuses a path that does not exist, and never
reads it as the preset it ends in (issue 29, items 1, 2 and 13)."""

from __future__ import annotations

import contextlib
import copy
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
from test_config_defaults import LLAMA3, hf_config_class, read, tiny_dict

import lenskit
from lenses.cli import main as cli_main
from lenskit import HookedTransformer, ModelConfig
from lenskit.families import FAMILIES as REGISTRY
from lenskit.families.fields import MAX_LAYERS

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
    if "num_key_value_heads" in d:  # latent attention (DeepSeek V3) runs in transformers only with one kv head per head
        d["num_key_value_heads"] = d["num_attention_heads"] if "kv_lora_rank" in d else 2
    try:  # built and run: OLMoE builds with a q norm of hidden_size features but fails in its forward
        hf_cfg = hf_config_class(family).from_dict(copy.deepcopy(d), experts_implementation="eager")
        getattr(transformers, FAMILY_CONFIGS[family][1])(hf_cfg).eval()(torch.tensor([[1, 2]]))
        accepted = True
    except Exception:  # noqa: BLE001 - transformers' validation errors are not all ValueErrors
        accepted = False
    ours = read(d)
    if accepted:
        # latent attention's widths are their own fields: d_head is v_head_dim, whatever hidden_size
        assert isinstance(ours, ModelConfig) and ours.d_head == d.get("v_head_dim", 8), ours
    else:
        assert isinstance(ours, ValueError) and f"{names[0]}=34" in str(ours) and f"{names[1]}=4" in str(ours), ours


def test_heads_rule_is_tested_both_ways():
    """The parity test above is not vacuous: some families refuse the shape and the others read it."""
    def refused(family: str) -> bool:
        names = ("n_embd", "n_head") if family == "gpt2" else ("hidden_size", "num_attention_heads")
        return isinstance(read(tiny_dict(family, **{names[0]: 34, names[1]: 4})), ValueError)

    assert {f for f in FAMILIES if refused(f)} == {"gpt2", "gpt_neox", "llama", "gemma2", "gemma3_text", "olmoe",
                                                     "granitemoehybrid"}


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
    assert math.isfinite(ModelConfig.from_name("EleutherAI/pythia-160m").rope.base)
