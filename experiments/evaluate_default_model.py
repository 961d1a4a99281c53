"""Measure the embedded model on its held-out split and write its model card (README.md + evaluation.json).

    python experiments/evaluate_default_model.py [--model lenskit/default_model]

The held-out loss is the mean next-token cross-entropy over non-overlapping n_ctx-token windows of the
held-out files (tokenized with the model's own tokenizer, files joined by <|endoftext|>). The unigram
entropy is that of the held-out tokens' own empirical unigram distribution: the best any model that
ignores context could do on this very text.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lenskit  # noqa: E402
from train_default_model import encode, heldout_loss, split_corpus  # noqa: E402


def measure(model_dir: str | Path, max_windows: int | None = None) -> dict:
    model = lenskit.HookedTransformer.from_pretrained(model_dir)
    _, heldout_text, corpus = split_corpus()
    tokens = encode(model.tokenizer, heldout_text)
    counts = torch.bincount(tokens.long(), minlength=model.cfg.d_vocab).double()
    p = counts[counts > 0] / counts.sum()
    loss = heldout_loss(model, tokens, model.cfg.n_ctx, max_windows)
    return {
        "python": corpus["python"],
        "heldout_files": corpus["heldout_files"],
        "heldout_tokens": len(tokens),
        "heldout_bytes": corpus["heldout_bytes"],
        "heldout_loss": round(loss, 4),
        "heldout_bits_per_byte": round(loss * len(tokens) / corpus["heldout_bytes"] / math.log(2), 4),
        "unigram_entropy": round(float(-(p * p.log()).sum()), 4),
        "windows": "all" if max_windows is None else max_windows,
    }


CARD = """# lenskit-stdlib-gpt2: the embedded default model

A small GPT-2 (the exact Hugging Face GPT-2 architecture and file layout) trained by lenskit's own
script on the source of Python's standard library, so that lenskit's commands have a model that has
learned something on a machine with no network. It is a toy for interpretability demos, not a
useful code model.

| | |
|---|---|
| corpus | `.py` files of the Python {python} standard library (`site-packages` excluded) |
| split | {split}: {train_files} train files ({train_bytes:,} bytes), {heldout_files} held-out files ({heldout_bytes:,} bytes) |
| tokenizer | byte-level BPE, {vocab} entries, trained on the train split with `tokenizers`, saved as GPT-2's `vocab.json` + `merges.txt` (and `tokenizer.json`); `<|endoftext|>` is id {eot} |
| architecture | GPT-2: {n_layer} layers, d_model {n_embd}, {n_head} heads, d_mlp {n_inner}, n_ctx {n_positions}, tied embeddings, pre-LN, GELU (tanh) |
| parameters | {params:,} |
| init | GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers) |
| training | AdamW (lr {lr}, betas 0.9/0.95, weight decay 0.1), warmup then cosine decay, batch {batch} x {ctx} tokens, {steps} steps, seed {seed} |
| tokens seen | {tokens_seen:,} |
| wall time | {minutes:.0f} minutes of training steps on 2 CPU cores (for about a quarter of the run the cores were shared with other work, so an idle machine is faster) |
| train loss (last 50 steps) | {final_train_loss:.3f} nats/token |
| held-out loss | **{heldout_loss:.4f} nats/token** ({heldout_bits_per_byte:.3f} bits/byte) over {heldout_tokens:,} held-out tokens |
| held-out unigram entropy | {unigram_entropy:.4f} nats/token |

Why this tokenizer: GPT-2's own BPE would make the 50,257-row unembedding about four times the size of
the rest of a model this small, and it would dominate CPU training time; a 4,096-entry BPE trained on
the corpus costs a fraction of that and compresses Python source well.

Reproduce (resumes from `runs/default_model/` if interrupted), then measure and write this card:

```bash
{command}
python experiments/evaluate_default_model.py --model lenskit/default_model
```

The held-out numbers above were written by `experiments/evaluate_default_model.py`;
`tests/test_default_model.py` measures them again and compares.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=lenskit.DEFAULT_MODEL)
    args = ap.parse_args()
    folder = Path(args.model)
    training = json.loads((folder / "training.json").read_text())
    result = measure(folder)
    (folder / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    cfg = training["config"]
    card = CARD.format(
        **result, **{k: v for k, v in training["corpus"].items() if k not in result}, **cfg,
        vocab=training["tokenizer"]["vocab"], eot=cfg["eos_token_id"], params=training["params"],
        lr=training["lr"], batch=training["batch"], ctx=training["ctx"], steps=training["steps"], seed=training["seed"],
        tokens_seen=training["tokens_seen"], minutes=training["train_seconds"] / 60,
        final_train_loss=training["final_train_loss"], command=training["command"],
    )
    (folder / "README.md").write_text(card)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
