"""GPT-2 checkpoint folders in each layout found in the wild, written from a transformers model: the config alone,
the prefixed keys with an lm_head, bare GPT2Model keys (tied), with the attention-mask buffers, and sharded with an
index. tests/test_loading.py loads each with golden parity; tests/test_loading_refusals.py damages them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from conftest import make_hf_gpt2
from safetensors.torch import load_file, save_file


def tiny_gpt2():
    """The 3-layer GPT-2 the loading tests write in every layout (d_model 32, vocabulary 101, 64 positions)."""
    return make_hf_gpt2(n_layer=3, n_embd=32, n_head=4, vocab_size=101, n_positions=64, seed=11)


def write_config(hf_model, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.config.to_json_file(str(folder / "config.json"))


def bare_state(hf_model) -> dict[str, torch.Tensor]:
    """GPT2Model's own keys (no `transformer.` prefix), contiguous copies ready for save_file."""
    return {k: v.detach().clone().contiguous() for k, v in hf_model.transformer.state_dict().items()
            if not re.fullmatch(r"h\.\d+\.attn\.(bias|masked_bias)", k)}  # layout (3) adds these on purpose


def layout_prefixed_with_lm_head(hf_model, folder: Path) -> Path:
    """(1) What GPT2LMHeadModel.save_pretrained writes, with `lm_head.weight` stored even when tied."""
    hf_model.save_pretrained(str(folder))
    state = load_file(str(folder / "model.safetensors"))
    assert all(k.startswith(("transformer.", "lm_head.")) for k in state)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["transformer.wte.weight"].clone()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layout_bare_tied(hf_model, folder: Path) -> Path:
    """(2) GPT2Model keys without prefix and no lm_head (the original openai-community/gpt2 file)."""
    write_config(hf_model, folder)
    state = bare_state(hf_model)
    assert not any(k.startswith("transformer.") or "lm_head" in k for k in state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layout_mask_buffers(hf_model, folder: Path) -> Path:
    """(3) Old checkpoints that saved the causal-mask buffers `h.{i}.attn.bias` / `attn.masked_bias`."""
    write_config(hf_model, folder)
    state = bare_state(hf_model)
    n = hf_model.config.n_positions
    for i in range(hf_model.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(n, n, dtype=torch.uint8).tril().view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layout_sharded(hf_model, folder: Path, n_shards: int = 3) -> Path:
    """(4) Tensors split over several files plus `model.safetensors.index.json`."""
    write_config(hf_model, folder)
    state = {f"transformer.{k}": v for k, v in bare_state(hf_model).items()}
    if not hf_model.config.tie_word_embeddings:
        state["lm_head.weight"] = hf_model.lm_head.weight.detach().clone()
    keys = sorted(state)
    weight_map = {}
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: state[k] for k in keys[s::n_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


LAYOUTS = {
    "prefixed+lm_head": layout_prefixed_with_lm_head,
    "bare-tied": layout_bare_tied,
    "mask-buffers": layout_mask_buffers,
    "sharded": layout_sharded,
}
