"""Helpers for the lens tests: a tiny tokenizer, a tiny model folder with it, deterministic text, random lenses."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from conftest import make_hf_gpt2

import lenskit
from lenses import TunedLens

EOT = "<|endoftext|>"


def sample_texts(n: int = 40, seed: int = 0) -> list[str]:
    """Python-like snippets from a seeded RNG: enough structure for a model to have something to predict."""
    rng = random.Random(seed)
    names = ["alpha", "beta", "gamma", "delta", "value", "item", "count", "total"]
    texts = []
    for i in range(n):
        lines = [f"def f{i}({rng.choice(names)}, {rng.choice(names)}):"]
        for _ in range(rng.randint(2, 6)):
            a, b = rng.choice(names), rng.choice(names)
            lines.append(f"    {a} = {b} + {rng.randint(0, 99)}")
        lines.append(f"    return {rng.choice(names)}\n")
        texts.append("\n".join(lines))
    return texts


def tiny_tokenizer(folder: Path, texts: list[str], vocab: int = 300):
    """A byte-level BPE with `vocab` entries trained on texts, saved and loaded as lenskit loads GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(folder))
    tokenizer = lenskit.io.loading.load_tokenizer(folder)
    tokenizer.add_special_tokens({"eos_token": EOT, "bos_token": EOT, "unk_token": EOT})
    return tokenizer


def write_tiny_model(folder: Path, seed: int = 0, n_layer: int = 3, n_embd: int = 32) -> Path:
    """A random 3-layer GPT-2 with a 300-entry tokenizer, saved in the Hugging Face layout."""
    tokenizer = tiny_tokenizer(folder / "_tok", sample_texts())
    hf = make_hf_gpt2(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=len(tokenizer), n_positions=64, seed=seed)
    model = lenskit.HookedTransformer.from_hf(hf, tokenizer=tokenizer)
    model.save_pretrained(folder)
    return folder


def write_text_folder(folder: Path, n: int = 40, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(sample_texts(n, seed)):
        (folder / f"snippet_{i:03d}.py").write_text(text)
    return folder


def random_tuned(model, seed: int = 0, scale: float = 0.1) -> TunedLens:
    """A tuned lens for `model` whose every parameter is seeded N(0, scale^2): far enough from the identity that
    a lens-dependent quantity differs from the logit lens's."""
    lens = TunedLens(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lens.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return lens
