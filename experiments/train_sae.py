"""The SAE that ships with lenskit: a TopK SAE on stdlib-gpt2's residual stream before block 3.

    python experiments/train_sae.py          # ~ 10 minutes on 1 CPU thread

1. `lenskit cache`: blocks.3.hook_resid_pre on about 1M tokens of the model's own training split (every 8th
   training file, `tuned_vs_logit.split_paths`), float16, into runs/sae_acts (resumed or reused);
2. `lenskit train-sae`: 1536 latents, k = 32, 3M tokens (three passes), lr 8e-4, into runs/sae_L3 (resumed or
   reused);
3. the result (cfg.json, sae_weights.safetensors, training.json, README.md card) copied into the package as
   lenskit/saes/stdlib_gpt2_sae_L3, loadable as `SAE.load("stdlib-gpt2-sae-L3")`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from tuned_vs_logit import split_paths

from lenses.cli import main as lenskit_main
from lenses.sae_training import card
from lenskit.saes import SAE

HOOK = "blocks.3.hook_resid_pre"
PACKAGE = ROOT / "lenskit" / "saes" / "stdlib_gpt2_sae_L3"


def run(argv: list[str]) -> None:
    print(f"lenskit {argv[0]} ...", flush=True)
    code = lenskit_main(argv)
    if code != 0:
        raise SystemExit(code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--acts", default=str(ROOT / "runs" / "sae_acts"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "sae_L3"))
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens exported (default 1M)")
    ap.add_argument("--train-tokens", type=int, default=3_000_000, help="about three passes over the export")
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--latents", type=int, default=1536)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    train_paths, _ = split_paths(8)
    manifest = Path(args.acts) / "manifest.json"
    if not (manifest.is_file() and json.loads(manifest.read_text()).get("complete", False)):
        run(["cache", "--model", "stdlib-gpt2", "--data", *map(str, train_paths), "--hooks", HOOK, "--out", args.acts,
             "--tokens", str(args.tokens), "--dtype", "float16", "--quiet"])
    run(["train-sae", "--model", "stdlib-gpt2", "--activations", args.acts, "--hook", HOOK, "--out", args.out,
         "--k", str(args.k), "--latents", str(args.latents), "--tokens", str(args.train_tokens), "--lr", str(args.lr)])

    meta = json.loads((Path(args.out) / "training.json").read_text())
    exported = json.loads(manifest.read_text())
    meta.update(model_name="stdlib-gpt2", activations="runs/sae_acts",
                data=f"stdlib-gpt2's own training split (every 8th training file of the standard library), "
                     f"{exported['n_windows'] * exported['ctx']:,} tokens exported")
    if PACKAGE.exists():
        shutil.rmtree(PACKAGE)
    sae = SAE.load(args.out)
    sae.save(PACKAGE, {"training_tokens": meta["training_tokens"], "trained_with": "lenskit train-sae"})
    (PACKAGE / "sae_weights.safetensors").chmod(0o644)  # package data: readable by every user
    (PACKAGE / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    (PACKAGE / "README.md").write_text(card(meta))
    size = sum(p.stat().st_size for p in PACKAGE.iterdir())
    print(f"wrote {PACKAGE} ({size / 2**20:.1f} MiB): {json.dumps(meta['eval'])}")


if __name__ == "__main__":
    main()
