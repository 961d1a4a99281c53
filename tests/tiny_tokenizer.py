"""A tiny byte-level BPE trained in memory, so lens tests can use text without the embedded model.

Shared by test_trajectory.py, test_plots.py and test_cli_lens.py (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import lenskit

CORPUS = ["def add(a, b):\n    return a + b\n", "import os\nprint('hello world')\n", "for i in range(10):\n    x = i\n"]
VOCAB = 300


def make_tokenizer(vocab_size: int = VOCAB) -> transformers.PreTrainedTokenizerBase:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text * 20 for text in CORPUS], trainer)
    assert tok.get_vocab_size() <= vocab_size
    return transformers.GPT2Tokenizer(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                      unk_token="<|endoftext|>")


def make_model_with_tokenizer(seed: int = 0) -> lenskit.HookedTransformer:
    from conftest import make_hf_gpt2

    return lenskit.HookedTransformer.from_hf(make_hf_gpt2(vocab_size=VOCAB, seed=seed), tokenizer=make_tokenizer())


def save_tiny_model(folder: Path) -> Path:
    make_model_with_tokenizer().save_pretrained(folder)
    return folder
