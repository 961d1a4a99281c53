"""TransformerLens's names for config fields (`cfg.act_fn`, `normalization_type`, `n_key_value_heads`, `eps`,
`d_vocab_out`, `positional_embedding_type`, `original_architecture`), each compared with what TransformerLens 4.3's
bridge reports for the same checkpoint, family by family."""

from __future__ import annotations

import pytest
from conftest import make_hf_family
from references import transformer_lens_4_3
from tiny_tokenizer import VOCAB, make_tokenizer

from lenskit import HookedTransformer, ModelConfig

NAMES = ("act_fn", "normalization_type", "n_key_value_heads", "eps", "d_vocab_out", "positional_embedding_type")


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama", "mistral", "qwen2", "gemma2"])
def test_transformerlens_config_names_say_what_its_bridge_says(family, tmp_path):
    transformer_lens_4_3()
    from transformer_lens.model_bridge import TransformerBridge

    make_hf_family(family, vocab_size=VOCAB).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    theirs = TransformerBridge.boot_transformers(str(tmp_path), device="cpu").cfg
    ours = HookedTransformer.from_pretrained(tmp_path).cfg
    got = {name: getattr(ours, name) for name in NAMES}
    want = {name: getattr(theirs, name) for name in NAMES}
    assert got == want
    assert ours.d_head == theirs.d_head and ours.n_ctx == theirs.n_ctx and ours.n_layers == theirs.n_layers


def test_the_names_follow_the_fields_they_alias():
    llama, gpt2 = ModelConfig.from_name("llama-3.1-8b"), ModelConfig.from_name("gpt2")
    assert (llama.act_fn, llama.normalization_type, llama.n_key_value_heads) == ("silu", "RMS", 8)
    assert (gpt2.act_fn, gpt2.normalization_type, gpt2.n_key_value_heads) == ("gelu_new", "LN", None)
    assert (llama.positional_embedding_type, gpt2.positional_embedding_type) == ("rotary", "standard")
    assert (llama.original_architecture, gpt2.original_architecture) == ("LlamaForCausalLM", "GPT2LMHeadModel")
    assert llama.eps == llama.norm_eps and gpt2.d_vocab_out == gpt2.d_vocab == 50257
    assert ModelConfig.from_name("gemma-2-2b").act_fn == "gelu_pytorch_tanh"
