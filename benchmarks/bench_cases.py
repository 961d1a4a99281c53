"""What is compared: the shared weights folder, the three models loaded from it, and the calls timed."""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from the local folder; never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/references.py

from references import resid_writes  # noqa: E402

from lenskit import HookedTransformer, ModelConfig  # noqa: E402

MATMUL_N = 2048  # the peak: an [N, N] @ [N, N] fp32 matmul, 2 N^3 FLOPs


def resid_names(n_layers: int) -> list[str]:
    """Every residual write: the five stream hooks of every block."""
    return resid_writes(n_layers)


# ------------------------------------------------------------------ the weights
def ensure_model_folder(folder: Path, seed: int) -> Path:
    """The gpt2 preset with GPT-2's random init, saved once in the Hugging Face layout."""
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(seed)
    HookedTransformer(ModelConfig.from_name("gpt2")).save_pretrained(folder)
    return folder


def load_lenskit(folder: Path, device: str = "cpu") -> HookedTransformer:
    return HookedTransformer.from_pretrained(folder, device=device).eval()


def load_transformers(folder: Path, device: str = "cpu"):
    import transformers

    transformers.logging.set_verbosity_error()
    # The default attention implementation (no attn_implementation argument): what a user gets.
    return transformers.GPT2LMHeadModel.from_pretrained(str(folder)).to(device).eval()


def load_transformer_lens(folder: Path, device: str = "cpu"):
    """TransformerLens' TransformerBridge over the same folder, or the reason it cannot be had."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as e:
        return None, f"transformer-lens is not installed ({e}); `pip install -e .[bench]`"
    import logging

    logging.getLogger("transformer_lens").setLevel(logging.ERROR)
    try:
        return TransformerBridge.boot_transformers(str(folder), device=device).eval(), ""
    except Exception as e:  # noqa: BLE001 - any failure to boot is reported, not fatal to the benchmark
        return None, f"TransformerBridge.boot_transformers failed offline: {type(e).__name__}: {e}"


def make_tokens(batch: int, pos: int, d_vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


# -------------------------------------------------------------------- the work
def contenders(lk, hf, tl, tokens: torch.Tensor, n_layers: int) -> dict[str, Callable[[], object]]:
    """What is timed, by name, for the models given (None skips one); each returns what a caller keeps."""
    names = resid_names(n_layers)
    wanted = set(names)
    cases: dict[str, Callable[[], object]] = {}
    if hf is not None:
        cases["transformers_forward"] = lambda: hf(tokens).logits
    if lk is not None:
        cases["lenskit_forward"] = lambda: lk(tokens)
        cases["lenskit_cache"] = lambda: lk.run_with_cache(tokens, names_filter=names)
    if tl is not None:
        cases["tl_forward"] = lambda: tl(tokens)
        cases["tl_cache"] = lambda: tl.run_with_cache(tokens, names_filter=lambda n: n in wanted)
    return cases


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    cuda = torch.cuda.is_initialized()  # GPU work is queued: wait for it before and after the clock
    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    del out
    return seconds


def matmul_case(n: int = MATMUL_N, device: str = "cpu") -> Callable[[], object]:
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device)
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(device)
    return lambda: a @ b


def forward_flops(cfg: ModelConfig, batch: int, pos: int, causal: bool = False) -> float:
    """Matmul FLOPs of one forward, counted as lenskit.accounting does (Kaplan et al.'s conventions).

    2 FLOPs per multiplied weight per token (qkv, out, fc_in, fc_out, unembed), plus the attention core
    (`Q K^T` and `pattern V`): 4 * n_layers * n_keys * d_attn per token, with n_keys = pos for the full
    score matrix, or the causal mean (pos + 1) / 2 when `causal`.
    """
    d, d_attn = cfg.d_model, cfg.n_heads * cfg.d_head
    weights_per_block = d * 3 * d_attn + d_attn * d + 2 * d * cfg.d_mlp
    dense = 2 * (cfg.n_layers * weights_per_block + d * cfg.d_vocab)
    n_keys = (pos + 1) / 2 if causal else pos
    return batch * pos * (dense + 4 * cfg.n_layers * n_keys * d_attn)




def gpu_cases(lk, tokens: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The GPU run's extra rows: the logit-lens trajectory and one tuned-lens training step (forward, readout KL,
    translator backward and Adam update) on the same tokens."""
    from lenses import LogitLens, Trajectory, TunedLens
    from lenses.training import collect_streams
    from lenses.training.step import TranslatedStreams, kl_step

    lens = TunedLens(lk)
    objective = TranslatedStreams(lens)
    opt = torch.optim.Adam(lens.parameters(), lr=1e-3)

    def train_step():
        with torch.inference_mode(False), torch.enable_grad():
            streams, final = collect_streams(lens, tokens)
            kl = kl_step(objective, lk.readout, streams, final, scale=1 / tokens.numel())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return kl

    return {"lenskit_logit_trajectory": lambda: Trajectory.from_prompt(LogitLens(lk), tokens),
            "lenskit_tuned_train_step": train_step}


def cuda_peak_memory(cases: dict[str, Callable[[], object]]) -> dict[str, int]:
    """Peak CUDA allocator bytes of one call of each case, above what was allocated before it."""
    peaks = {}
    for name, fn in cases.items():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.inference_mode():
            out = fn()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del out
    return peaks
