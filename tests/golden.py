"""The reference side of the golden tests: what `transformers`' own model of each family computes, read with torch hooks.

Shared by test_model.py, test_loading.py, test_hub.py and test_families.py (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import torch

import lenskit
from lenskit import Stream

ATOL = 1e-4
STREAM_POINTS = ("resid_pre", "attn_out", "mlp_out", "resid_post")  # what transformers' modules show directly


def hf_blocks(hf) -> list:
    """The block list of a transformers causal LM of any supported family."""
    base = getattr(hf, "transformer", None) or getattr(hf, "gpt_neox", None) or getattr(hf, "model", None) or hf
    return list(getattr(base, "h", None) or base.layers)

def hf_module_outputs(hf, tokens, module: str, keep=lambda m: True) -> dict[int, object]:
    """Each block's `module` (e.g. "mlp.router") output in transformers' own forward, by block index; blocks whose
    module fails `keep` (e.g. a dense block's MLP, which has no router) are left out."""
    seen, handles = {}, []
    for i, block in enumerate(hf_blocks(hf)):
        target = block.get_submodule(module) if _has(block, module) else None
        if target is not None and keep(target):
            handles.append(target.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out)))
    run_then_remove(hf, tokens, handles)
    return seen



def run_then_remove(hf, tokens, handles) -> None:
    """Run the transformers model `hf` on `tokens` without gradients, then remove the torch hooks `handles`, also
    when the run raises."""
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in handles:
            h.remove()


def _has(block, module: str) -> bool:
    try:
        block.get_submodule(module)
    except AttributeError:
        return False
    return True



def hf_attention(block):
    # Qwen 3.5's linear-attention blocks hold a `linear_attn` where the others hold `self_attn`
    return (getattr(block, "attn", None) or getattr(block, "attention", None) or getattr(block, "linear_attn", None)
            or block.self_attn)


def hf_writes(block) -> tuple:
    """The modules whose outputs are added to the stream: the attention and the MLP, or, in blocks with a
    norm after each sublayer (Gemma 2/3, OLMo 2: `post_attention_layernorm` follows attention there), those norms."""
    if hasattr(block, "post_feedforward_layernorm"):
        return block.post_attention_layernorm, block.post_feedforward_layernorm
    if hasattr(block, "mamba") and hasattr(block, "feed_forward"):  # Falcon-H1: see `_beside_attention`
        return None, block.feed_forward
    return hf_attention(block), getattr(block, "mlp", None) or block.feed_forward  # Llama 4's is `feed_forward`


@torch.no_grad()
def hf_reference(hf, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and, per block i, `blocks.{i}.hook_resid_pre / attn_out / mlp_out / resid_post` from transformers.

    resid_pre is the input of block i, attn_out and mlp_out what its attention and MLP add to the stream
    (after any post-sublayer norm, see `hf_writes`), resid_post the block's output (before the final norm for the last block).
    """
    acts: dict[str, torch.Tensor] = {}
    handles = []

    def first(x):
        return x[0] if isinstance(x, tuple) else x

    def save_out(name):
        return lambda mod, args, out: acts.__setitem__(name, first(out).detach().clone())

    def save_write(name):  # Llama 4's MoE returns its write flat, [batch * pos, d_model]: as its input is shaped
        return lambda mod, args, out: acts.__setitem__(name, first(out).detach().clone().view(args[0].shape))

    def save_in(name):
        def pre(mod, args, kwargs):
            acts[name] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return pre

    try:
        n = len(hf_blocks(hf))
        for i, block in enumerate(hf_blocks(hf)):
            name = {p: Stream(i, p).hook_name(n) for p in STREAM_POINTS}
            handles.append(block.register_forward_pre_hook(save_in(name["resid_pre"]), with_kwargs=True))
            absent = None
            if hasattr(block, "mixer"):  # Nemotron-H: one sublayer per layer, the other half writes nothing
                present, absent = ("mlp_out", "attn_out") if block.block_type in ("mlp", "moe") else ("attn_out", "mlp_out")
                handles.append(block.mixer.register_forward_hook(save_out(name[present])))
            elif hasattr(block, "residual_multiplier"):  # Granite 4: the block adds each sublayer's output times it
                handles += granite_writes(block, name, acts)
            else:
                attn_write, mlp_write = hf_writes(block)
                if attn_write is None:  # Falcon-H1: attention and the mixer beside it, read as the MLP's input
                    handles.append(block.pre_ff_layernorm.register_forward_pre_hook(save_in(f"{i}.resid_mid"),
                                                                                    with_kwargs=True))
                else:
                    handles.append(attn_write.register_forward_hook(save_out(name["attn_out"])))
                handles.append(mlp_write.register_forward_hook(save_write(name["mlp_out"])))
            handles.append(block.register_forward_hook(save_out(name["resid_post"])))
            if absent is not None:
                handles.append(block.register_forward_hook(
                    lambda mod, args, out, n=name[absent]: acts.__setitem__(n, torch.zeros_like(first(out)))))
        logits = hf(tokens).logits
    finally:
        for h in handles:
            h.remove()
    _beside_attention(acts, len(hf_blocks(hf)))
    return logits, acts


def _beside_attention(acts: dict[str, torch.Tensor], n: int) -> None:
    """Falcon-H1's blocks scale and add their attention's and Mamba-2 mixer's writes inside the block's own forward, so
    no module outputs the sum: it is read as the block's stream after it (the MLP's norm's input) less the stream before."""
    for i in range(n):
        mid = acts.pop(f"{i}.resid_mid", None)
        if mid is not None:
            acts[Stream(i, "attn_out").hook_name(n)] = mid - acts[Stream(i, "resid_pre").hook_name(n)]
def granite_writes(block, name: dict[str, str], acts: dict[str, torch.Tensor]) -> list:
    """Hooks that record a Granite 4 block's writes as it adds them: its mixer's (Mamba-2 or attention) output times
    `residual_multiplier`, and the sum of its experts' and shared MLP's outputs times it."""
    m = block.residual_multiplier
    mixer = block.mamba if block.mamba is not None else block.self_attn

    def mixed(mod, args, out):
        acts[name["attn_out"]] = (out[0] if isinstance(out, tuple) else out).detach() * m

    parts = [block.shared_mlp] + ([block.block_sparse_moe] if block.has_experts else [])
    outs: list[torch.Tensor] = []

    def part(mod, args, out):
        outs.append(out.detach())
        if len(outs) == len(parts):
            acts[name["mlp_out"]] = sum(outs[::-1]) * m  # transformers adds the experts' output to the shared MLP's

    return [mixer.register_forward_hook(mixed), *(p.register_forward_hook(part) for p in parts)]


def rounding(model: lenskit.HookedTransformer, tokens: torch.Tensor) -> float:
    """How far float rounding moves the logits when the model's sums are taken in another order (a cache, another
    kernel, another CPU): eps of the model's dtype x the terms summed on the way (d_model per block and in the
    readout) x the largest value the residual stream carries. A scale derived from the dtype and the values, not from
    one machine's run; a real bug (a wrong key, a wrong position) moves the logits by orders of magnitude more."""
    names = [f"blocks.{i}.hook_resid_post" for i in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names)
    size = max(1.0, max(cache[n].abs().max().item() for n in names))
    return torch.finfo(model.cfg.dtype).eps * model.cfg.d_model * (model.cfg.n_layers + 1) * size


def stream_names(n_layers: int) -> list[str]:
    return [Stream(i, p).hook_name(n_layers) for i in range(n_layers) for p in STREAM_POINTS]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_golden(model: lenskit.HookedTransformer, hf, tokens: torch.Tensor, atol: float = ATOL, **run_kwargs) -> float:
    """Logits and every stream hook of `model` match transformers within `atol`; returns the largest gap."""
    ref_logits, ref = hf_reference(hf, tokens)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=stream_names(model.cfg.n_layers), **run_kwargs)
    assert logits.shape == ref_logits.shape
    worst = max_diff(logits, ref_logits)
    assert worst <= atol, f"logits differ by {worst:.3g}"
    for name, want in ref.items():
        gap = max_diff(cache[name], want)
        assert gap <= atol, f"{name} differs from transformers by {gap:.3g}"
        worst = max(worst, gap)
    return worst
