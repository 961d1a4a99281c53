"""Measure an embedded model and write its model card (README.md + evaluation.json): the GPT-2 (`stdlib-gpt2`)
or its Llama-architecture sibling (`stdlib-llama`).

    python experiments/evaluate_default_model.py [--model lenskit/default_model | lenskit/stdlib_llama]

- Held-out loss: the mean next-token cross-entropy over non-overlapping n_ctx-token windows of the held-out
  standard-library files (tokenized with the model's own tokenizer, files joined by <|endoftext|>), in
  nats/token and bits/byte.
- Unseen code: the same on every .py file of one installed third-party package the model never saw,
  `tqdm` (a lenskit dependency, so it is installed wherever lenskit is; its version is recorded).
- Unigram entropies: those of each text's own empirical unigram distribution, the best any model that
  ignores context could do on that very text.
- Greedy completions of three fixed prompts, 24 tokens each.
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
from train_default_model import encode, heldout_loss, split_corpus  # noqa: E402

import lenskit  # noqa: E402

UNSEEN_PACKAGE = "tqdm"
PROMPTS = ("def __init__(self, name):\n    self.name =", "import os\nimport", "for i in range(")
COMPLETION_TOKENS = 24
GPT2_HELDOUT_LOSS = 2.7938  # stdlib-gpt2's held-out loss (its evaluation.json), the sibling's yardstick


def unseen_texts() -> tuple[list[str], str]:
    """The .py files of the unseen package, sorted by path, and its version."""
    module = __import__(UNSEEN_PACKAGE)
    root = Path(module.__file__).parent
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.rglob("*.py"))], module.__version__


def unigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(tokens.long(), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def completions(model: lenskit.HookedTransformer) -> dict[str, str]:
    """Greedy continuations (the new text only) of PROMPTS."""
    out = {}
    for prompt in PROMPTS:
        text = model.to_string(model.generate(prompt, max_new_tokens=COMPLETION_TOKENS))[0]
        out[prompt] = text[len(prompt):]
    return out


def measure(model_dir: str | Path, max_windows: int | None = None) -> dict:
    model = lenskit.HookedTransformer.from_pretrained(model_dir)
    _, heldout_text, corpus = split_corpus()
    tokens = encode(model.tokenizer, heldout_text)
    loss = heldout_loss(model, tokens, model.cfg.n_ctx, max_windows)
    texts, version = unseen_texts()
    unseen = encode(model.tokenizer, texts)
    unseen_bytes = sum(len(t.encode()) for t in texts)
    unseen_loss = heldout_loss(model, unseen, model.cfg.n_ctx, max_windows)
    return {
        "python": corpus["python"],
        "heldout_files": corpus["heldout_files"],
        "heldout_tokens": len(tokens),
        "heldout_bytes": corpus["heldout_bytes"],
        "heldout_loss": round(loss, 4),
        "heldout_bits_per_byte": round(loss * len(tokens) / corpus["heldout_bytes"] / math.log(2), 4),
        "unigram_entropy": round(unigram_entropy(tokens, model.cfg.d_vocab), 4),
        "unseen_package": f"{UNSEEN_PACKAGE} {version}",
        "unseen_files": len(texts),
        "unseen_tokens": len(unseen),
        "unseen_loss": round(unseen_loss, 4),
        "unseen_bits_per_byte": round(unseen_loss * len(unseen) / unseen_bytes / math.log(2), 4),
        "unseen_unigram_entropy": round(unigram_entropy(unseen, model.cfg.d_vocab), 4),
        "completions": completions(model),
        "windows": "all" if max_windows is None else max_windows,
    }


def architecture(cfg: dict) -> str:
    """The card's architecture line, from config.json."""
    if cfg["model_type"] == "gpt2":
        return (f"GPT-2: {cfg['n_layer']} layers, d_model {cfg['n_embd']}, {cfg['n_head']} heads, d_mlp {cfg['n_inner']}, "
                f"n_ctx {cfg['n_positions']}, tied embeddings, pre-LN LayerNorm, GELU (tanh), learned positions")
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta")}
    return (f"Llama: {cfg['num_hidden_layers']} layers, d_model {cfg['hidden_size']}, {cfg['num_attention_heads']} query heads "
            f"and {cfg['num_key_value_heads']} key/value heads (GQA), SwiGLU d_mlp {cfg['intermediate_size']}, "
            f"n_ctx {cfg['max_position_embeddings']}, {'tied' if cfg.get('tie_word_embeddings') else 'untied'} embeddings, "
            f"pre-LN RMSNorm (eps {cfg['rms_norm_eps']:g}), rotary positions (base {rope['rope_theta']:g}), no biases")


TITLES = {"gpt2": ("lenskit-stdlib-gpt2: the embedded default model (`stdlib-gpt2`)",
                   "A small GPT-2 (the exact Hugging Face GPT-2 architecture and file layout)"),
          "llama": ("lenskit-stdlib-llama: the embedded Llama sibling (`stdlib-llama`)",
                    "A small Llama (the Hugging Face Llama architecture and file layout: `LlamaForCausalLM` loads it)")}
WHY = {"gpt2": "",
       "llama": """
It is the GPT-2's sibling: the same corpus split, tokenizer, token stream, batch order, token budget,
optimiser, schedule, seed and init (N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)) as
`stdlib-gpt2`; only the architecture differs. The SwiGLU width is the one whose parameter count is nearest
the GPT-2's 3,505,152, and the embeddings are tied as the GPT-2's are, so that the 786,432 embedding
parameters are the same share of both models and the comparison is of the blocks
(`experiments/architectures.py` puts the two side by side under every lens).
"""}

CARD = """# {title}

{lead} trained by lenskit's own
script on the source of Python's standard library, so that lenskit's commands have a model that has
learned something on a machine with no network. It is a toy for interpretability demos, not a
useful code model.
{why}
| | |
|---|---|
| corpus | `.py` files of the Python {python} standard library (`site-packages` excluded) |
| split | {split}: {train_files} train files ({train_bytes:,} bytes), {heldout_files} held-out files ({heldout_bytes:,} bytes) |
| tokenizer | byte-level BPE, {vocab} entries, trained on the train split with `tokenizers`, saved as GPT-2's `vocab.json` + `merges.txt` (and `tokenizer.json`); `<|endoftext|>` is id {eot} |
| architecture | {architecture} |
| parameters | {params:,} |
| init | GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers) |
| training | AdamW (lr {lr}, betas 0.9/0.95, weight decay 0.1), warmup then cosine decay, batch {batch} x {ctx} tokens, {steps} steps, seed {seed} |
| tokens seen | {tokens_seen:,} |
| wall time | {wall} |{speed}
| train loss (last 50 steps) | {final_train_loss:.3f} nats/token |
| held-out loss | **{heldout_loss:.4f} nats/token** ({heldout_bits_per_byte:.3f} bits/byte) over {heldout_tokens:,} held-out tokens{yardstick} |
| held-out unigram entropy | {unigram_entropy:.4f} nats/token |
| unseen package | `{unseen_package}` ({unseen_files} files, {unseen_tokens:,} tokens): **{unseen_loss:.4f} nats/token** ({unseen_bits_per_byte:.3f} bits/byte); its unigram entropy {unseen_unigram_entropy:.4f} |

Greedy completions ({n_new} new tokens; `\\n` is a newline):

| prompt | completion |
|---|---|
{completion_rows}

{tokenizer_note}

Reproduce (resumes from its work folder if interrupted), then measure and write this card:

```bash
{command}
python experiments/evaluate_default_model.py --model {folder}
```

The numbers above were written by `experiments/evaluate_default_model.py`; `tests/test_default_model.py`
measures them again and compares.
"""

TOKENIZER_NOTE = ("Why this tokenizer: GPT-2's own BPE would make the 50,257-row unembedding about four times the size of\n"
                  "the rest of a model this small, and it would dominate CPU training time; a 4,096-entry BPE trained on\n"
                  "the corpus costs a fraction of that and compresses Python source well.")


def _cell(text: str) -> str:
    return "`" + text.replace("\n", "\\n").replace("|", "\\|").replace("`", "'") + "`"


def wall_time(training: dict) -> str:
    minutes = training["train_seconds"] / 60
    threads = training.get("threads", 2)
    note = training.get("wall_note", "")
    return f"{minutes:.0f} minutes of training steps on {threads} CPU thread{'s' if threads > 1 else ''}{note}"


def _in_repo(folder: Path) -> str:
    """The folder as the card names it: relative to the checkout (lenskit/stdlib_llama) wherever it is given from."""
    root = Path(__file__).resolve().parents[1]
    try:
        return folder.resolve().relative_to(root).as_posix()
    except ValueError:
        return folder.as_posix()


def write_card(folder: Path, result: dict, training: dict) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    arch = "gpt2" if cfg["model_type"] == "gpt2" else "llama"
    title, lead = TITLES[arch]
    yardstick = "" if arch == "gpt2" else f" (stdlib-gpt2: {GPT2_HELDOUT_LOSS})"
    return CARD.format(
        **result, **{k: v for k, v in training["corpus"].items() if k not in result},
        title=title, lead=lead, why=WHY[arch], architecture=architecture(cfg), yardstick=yardstick,
        vocab=training["tokenizer"]["vocab"], eot=cfg["eos_token_id"], params=training["params"],
        lr=training["lr"], batch=training["batch"], ctx=training["ctx"], steps=training["steps"], seed=training["seed"],
        tokens_seen=training["tokens_seen"], wall=wall_time(training),
        speed=f"\n| bf16 autocast, torch.compile | {training['speed_note']} |" if "speed_note" in training else "", final_train_loss=training["final_train_loss"],
        command=training["command"], folder=_in_repo(folder), n_new=COMPLETION_TOKENS, tokenizer_note=TOKENIZER_NOTE,
        completion_rows="\n".join(f"| {_cell(p)} | {_cell(c)} |" for p, c in result["completions"].items()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="lenskit/default_model", help="an embedded model's folder")
    args = ap.parse_args()
    folder = Path(args.model)
    training = json.loads((folder / "training.json").read_text())
    result = measure(folder)
    (folder / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    (folder / "README.md").write_text(write_card(folder, result, training))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
