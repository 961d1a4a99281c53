"""Train lenskit's embedded models on the running Python's standard library source: the small GPT-2
(`stdlib-gpt2`, the default) and its Llama-architecture sibling (`stdlib-llama`).

Reproduce (each resumes from its --work folder when interrupted):

    python experiments/train_default_model.py --out lenskit/default_model
    python experiments/train_default_model.py --arch llama --tokenizer lenskit/default_model \
        --work runs/stdlib_llama --out lenskit/stdlib_llama

The two runs hold everything fixed except the architecture: the corpus split, the tokenizer (the
sibling reuses the GPT-2's files), the token stream, the batch order (a function of seed and step),
the token budget, the optimiser, the schedule and the seed.

The tokenizer is a byte-level BPE with 4,096 entries trained on the training split and saved in
GPT-2's own file format (vocab.json + merges.txt). GPT-2's 50,257-row unembedding would be ~4x the
rest of a model this size and dominate CPU training time; a code-specific BPE also compresses
Python source better.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lenskit  # noqa: E402
from lenskit.config import ModelConfig  # noqa: E402
from lenskit.io.data import HELDOUT_BUCKETS, is_heldout, stdlib_files  # noqa: E402

EOT = "<|endoftext|>"


def split_corpus() -> tuple[list[str], list[str], dict]:
    train, val = [], []
    n_train = n_val = 0
    for rel, path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        (val if is_heldout(rel) else train).append(text)
        n_val += is_heldout(rel)
        n_train += not is_heldout(rel)
    meta = {
        "python": platform.python_version(),
        "stdlib": sysconfig.get_paths()["stdlib"],
        "train_files": n_train,
        "heldout_files": n_val,
        "train_bytes": sum(len(t.encode()) for t in train),
        "heldout_bytes": sum(len(t.encode()) for t in val),
        "split": f"file-level: sha1(relative path) % {HELDOUT_BUCKETS} == 0 is held out",
    }
    return train, val, meta


def train_tokenizer(texts: list[str], vocab_size: int, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(folder))  # GPT-2's format: vocab.json + merges.txt


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def batch_at(tokens: torch.Tensor, step: int, seed: int, batch: int, ctx: int) -> torch.Tensor:
    """The batch for `step`: a pure function of (seed, step), so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - ctx - 1, (batch,), generator=g)
    return torch.stack([tokens[s: s + ctx + 1] for s in starts.tolist()]).long()


@torch.no_grad()
def heldout_loss(model: lenskit.HookedTransformer, tokens: torch.Tensor, ctx: int, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping ctx-token windows of the held-out stream."""
    model.eval()
    n = (len(tokens) - 1) // ctx
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        rows = [tokens[j * ctx: j * ctx + ctx + 1] for j in range(i, min(n, i + 16))]
        x = torch.stack(rows).long()
        logits = model(x[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


def unigram_entropy(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of held-out tokens under add-one-smoothed train unigram frequencies."""
    counts = torch.bincount(train.long(), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout.long()].mean())


def save_atomic(tensors: dict, meta: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"meta": json.dumps(meta)})
    os.replace(tmp, path)


ARCHS = ("gpt2", "llama")


def llama_d_mlp(d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab: int, target: int) -> int:
    """The SwiGLU width (a multiple of 8) whose tied Llama has the parameter count nearest `target`."""
    d_head = d_model // n_heads
    fixed = vocab * d_model + d_model + n_layers * (2 * d_model * d_model + 2 * d_model * n_kv_heads * d_head + 2 * d_model)
    return 8 * round((target - fixed) / (n_layers * 3 * d_model) / 8)


def model_config(args: argparse.Namespace, vocab: int, eot: int) -> ModelConfig:
    common = dict(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, d_vocab=vocab, n_ctx=args.ctx,
                  bos_token_id=eot, eos_token_id=eot, name=args.name or f"lenskit-stdlib-{args.arch}")
    if args.arch == "gpt2":
        return ModelConfig(**common, d_mlp=args.d_mlp)
    # Tied like the GPT-2, so the embedding is the same 786k parameters in both and the comparison is of the blocks.
    gpt2 = ModelConfig(**common)
    target = sum(p.numel() for p in lenskit.HookedTransformer(gpt2).parameters())
    d_mlp = args.d_mlp or llama_d_mlp(args.d_model, args.layers, args.heads, args.kv_heads, vocab, target)
    return ModelConfig(**common, family="llama", norm="rmsnorm", mlp="swiglu", positional="rotary", n_kv_heads=args.kv_heads,
                       d_mlp=d_mlp, fused_qkv=False, qkv_bias=False, out_bias=False, mlp_bias=False, norm_eps=1e-5,
                       rotary_base=10000.0, tie_word_embeddings=True)


def autocast(args: argparse.Namespace):
    if args.autocast == "bf16":
        return torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="lenskit/default_model")
    ap.add_argument("--work", default="runs/default_model", help="checkpoints and token caches")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--arch", choices=ARCHS, default="gpt2")
    ap.add_argument("--kv-heads", type=int, default=2, help="llama only: key/value heads (grouped-query attention)")
    ap.add_argument("--d-mlp", type=int, default=None,
                    help="default: 4 * d_model for gpt2; for llama, the SwiGLU width that matches the GPT-2's parameter count")
    ap.add_argument("--tokenizer", default=None, help="reuse this folder's vocab.json + merges.txt instead of training a BPE")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--autocast", choices=("none", "bf16"), default="none", help="bf16 autocast of the forward and backward")
    ap.add_argument("--name", default=None, help="the model's name (default: lenskit-stdlib-ARCH)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)

    # ---- corpus, tokenizer, token streams (cached in work/)
    train_text, val_text, corpus = split_corpus()
    tok_dir = work / "tokenizer"
    if args.tokenizer and not (tok_dir / "merges.txt").exists():
        tok_dir.mkdir(parents=True, exist_ok=True)
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(Path(args.tokenizer) / f, tok_dir / f)
    if not (tok_dir / "merges.txt").exists():
        print(f"training a {args.vocab}-entry byte-level BPE on {corpus['train_files']} files", flush=True)
        train_tokenizer(train_text, args.vocab, tok_dir)
    tokenizer = lenskit.io.loading.load_tokenizer(tok_dir)
    tokenizer.add_special_tokens({"eos_token": EOT, "bos_token": EOT, "unk_token": EOT})
    streams = work / "tokens.safetensors"
    if not streams.exists():
        save_file({"train": encode(tokenizer, train_text), "heldout": encode(tokenizer, val_text)}, str(streams))
    data = load_file(str(streams))
    train_tokens, val_tokens = data["train"], data["heldout"]
    print(f"train {len(train_tokens):,} tokens, held-out {len(val_tokens):,} tokens", flush=True)

    eot = tokenizer.convert_tokens_to_ids(EOT)
    cfg = model_config(args, len(tokenizer), eot)
    torch.manual_seed(args.seed)
    model = lenskit.HookedTransformer(cfg, tokenizer=tokenizer)  # GPT-2 init, 1/sqrt(2N) residual scaling
    model.to(args.device)
    print(f"{args.arch}: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    # ---- resume
    ckpt = work / "checkpoint.safetensors"
    step, elapsed, losses = 0, 0.0, []
    if ckpt.exists():
        tensors = load_file(str(ckpt))
        from safetensors import safe_open
        with safe_open(str(ckpt), "pt") as f:
            meta = json.loads(f.metadata()["meta"])
        state = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
        state.setdefault("unembed.weight", state["embed.weight"])  # tied, so saved once
        model.load_state_dict(state)
        model.tie_weights()
        tensors = {k: v.to(args.device) for k, v in tensors.items()}
        for i, p in enumerate(model.parameters()):
            if f"opt.{i}.exp_avg" in tensors:
                opt.state[p] = {"step": tensors[f"opt.{i}.step"].reshape(()), "exp_avg": tensors[f"opt.{i}.exp_avg"],
                                "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"]}
        step, elapsed, losses = meta["step"], meta["elapsed"], meta["losses"]
        print(f"resumed from step {step}", flush=True)

    def checkpoint() -> None:
        tensors = {f"model.{k}": v for k, v in model.state_dict().items() if k != "unembed.weight" or not cfg.tie_word_embeddings}
        for i, p in enumerate(model.parameters()):
            for key, value in opt.state.get(p, {}).items():
                tensors[f"opt.{i}.{key}"] = (value.reshape(1) if value.ndim == 0 else value).cpu()
        save_atomic(tensors, {"step": step, "elapsed": elapsed, "losses": losses}, ckpt)

    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True, mininterval=5)
    while step < args.steps:
        t0 = time.time()
        x = batch_at(train_tokens, step, args.seed, args.batch, args.ctx).to(args.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with autocast(args):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; the last checkpoint in {ckpt} is intact")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed += time.time() - t0
        losses.append(round(loss.item(), 4))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if step % args.ckpt_every == 0 or step == args.steps:
            checkpoint()
    bar.close()

    # ---- export in the family's HF layout, then measure and write the model card
    model.eval()
    model.cpu()
    model.save_pretrained(out)
    card = {
        "corpus": corpus, "tokenizer": {"kind": "byte-level BPE (tokenizers), GPT-2 file format", "vocab": len(tokenizer)},
        "config": cfg.to_hf_dict(), "params": sum(p.numel() for p in model.parameters()),
        "steps": step, "batch": args.batch, "ctx": args.ctx, "tokens_seen": step * args.batch * args.ctx,
        "train_seconds": round(elapsed, 1), "lr": args.lr, "seed": args.seed, "device": args.device,
        "autocast": args.autocast, "threads": args.threads,
        "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    (out / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    print("wrote", out, flush=True)


if __name__ == "__main__":
    main()
