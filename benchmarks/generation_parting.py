"""Greedy generation, lenskit (KV cache) against transformers' `generate`, on the same weights: how fast, how many
tokens agree, and where they part, why: the logit margin at the first parting position in bf16 and in an fp32 run
of the same weights, and each library's cached run against its own uncached run. A case of gpu_side_by_side.py."""

from __future__ import annotations

import torch
from gpu_bench import Bench, random_ids, say


def case_generate(b: Bench, m: dict, size: dict) -> None:
    import lenskit

    ours, hf, n_prompt, new = m["ours"], m["hf"], size["prompt"], size["new"]
    prompt = random_ids(n_prompt, m["cfg"].d_vocab, b.device, seed=4)
    mask = torch.ones_like(prompt)

    def theirs(cache: bool = True) -> torch.Tensor:
        return hf.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=cache,
                           pad_token_id=0, eos_token_id=None)

    b_gen = Bench(b.device, max(1, b.repeats - 1))
    r = b_gen.run({"lenskit": lambda: ours.generate(prompt, new, stop_at_eos=False),
                   "transformers": lambda: theirs()})
    a, t = r["lenskit"]["out"][0, n_prompt:], r["transformers"]["out"][0, n_prompt:]
    same = (a == t)
    first = int((~same).nonzero()[0]) if not same.all() else None
    uncached_ours = ours.generate(prompt, new, stop_at_eos=False, use_past_kv_cache=False)[0, n_prompt:]
    uncached_theirs = theirs(cache=False)[0, n_prompt:]
    say(f"\n### greedy generation, {n_prompt}-token prompt, {new} new tokens: lenskit (KV cache) / transformers `generate`\n")
    say("| lenskit s | transformers s | ratio | tokens agreeing | first position they part | lenskit cached = its uncached "
        "| transformers cached = its uncached |")
    say("|---|---|---|---|---|---|---|")
    say(f"| {r['lenskit']['s']:.3f} | {r['transformers']['s']:.3f} | {r['lenskit']['s'] / r['transformers']['s']:.2f} "
        f"| {same.float().mean().item():.1%} | {'-' if first is None else first} "
        f"| {(uncached_ours == a).float().mean().item():.1%} | {(uncached_theirs == t).float().mean().item():.1%} |")
    if first is None:
        say("\nThe two generations agree at every position.")
        return
    prefix = torch.cat([prompt[0], a[:first]])[None]  # what both had generated before they parted
    x, y = int(a[first]), int(t[first])
    with torch.no_grad():
        l_ours = ours(prefix)[0, -1].float()
        l_hf = hf(prefix).logits[0, -1].float()
        m.pop("bridge", None)  # room for the fp32 copy
        if b.cuda:
            torch.cuda.empty_cache()
        fp32 = lenskit.HookedTransformer.from_pretrained(m["folder"], dtype="fp32", device=b.device)
        l32 = fp32(prefix)[0, -1].float()
        del fp32
    gap32 = (l32[x] - l32[y]).item()
    # bf16 rounding at this position: lenskit's bf16 logits against the same weights in fp32 (which equal
    # transformers' fp32 logits to ~1e-5: tests/test_cuda.py, the golden tests)
    ours_error = max(abs(l_ours[x] - l32[x]), abs(l_ours[y] - l32[y])).item()
    hf_error = max(abs(l_hf[x] - l32[x]), abs(l_hf[y] - l32[y])).item()
    top2 = torch.topk(l32, 2).values
    say(f"\nAt position {first} lenskit chose {x}, transformers {y}. Logit of {x} minus that of {y}: lenskit bf16 "
        f"{(l_ours[x] - l_ours[y]).item():+.4f}, transformers bf16 {(l_hf[x] - l_hf[y]).item():+.4f}, fp32 {gap32:+.4f} "
        f"(fp32's top-2 gap there {(top2[0] - top2[1]).item():.4f}). The bf16 logits of these two tokens are off the fp32 "
        f"ones by up to {ours_error:.4f} (lenskit) and {hf_error:.4f} (transformers).")
    parted = [name for name, cached, uncached in (("lenskit", a, uncached_ours), ("transformers", t, uncached_theirs))
              if not torch.equal(cached[:first + 1], uncached[:first + 1])]
    if parted:
        say(f"Verdict: a cached-path difference: {' and '.join(parted)}'s cached run differs from its own uncached run "
            f"by position {first}.")
    elif hf_error > 4 * max(ours_error, 1e-3):
        say("Verdict: transformers' bf16 logits there are further from fp32 than bf16 rounding explains (its forward, "
            "not its cache: its cached and uncached runs agree up to there).")
    elif abs(gap32) <= 2 * max(ours_error, hf_error):
        say("Verdict: bf16 rounding on near-tied logits (the fp32 gap is within twice the bf16 error), not a difference "
            "in the cached path (each library's cached run equals its uncached run up to there); after it the two "
            "continue different texts, so they rarely agree again.")
    else:
        say("Verdict: the two bf16 runs disagree by more than bf16 rounding explains, with neither cache at fault "
            "(each cached run equals its uncached one up to there): compare the two forwards at this prefix.")
