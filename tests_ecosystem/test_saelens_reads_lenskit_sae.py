"""SAELens itself reads the SAEs lenskit writes: `lenskit train-sae`'s folder and the shipped stdlib-gpt2-sae-L3 load
with `sae_lens.SAE.load_from_disk`, and SAELens's encode and decode equal lenskit's. Runs in the ecosystem
environment (scripts/ecosystem_env.sh); skipped where sae_lens is not installed."""

from __future__ import annotations

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

import lenskit
from lenses.activation_export import export_activations
from lenses.sae_training import SAERecipe, train_sae
from lenskit.saes import SAE
from lenskit.saes.formats import EMBEDDED_SAES

HOOK = "blocks.1.hook_resid_pre"


def same_codes(ours: SAE, folder, x: torch.Tensor) -> None:
    theirs = sae_lens.SAE.load_from_disk(str(folder), device="cpu")
    assert theirs.cfg.d_in == ours.d_in and theirs.cfg.d_sae == ours.d_sae
    assert theirs.cfg.metadata.hook_name == ours.hook_name
    with torch.no_grad():
        f = theirs.encode(x)
        torch.testing.assert_close(f, ours.encode(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs.decode(f), ours.decode(f), rtol=1e-5, atol=1e-5)
    assert int((f > 0).sum(-1).max()) <= ours.cfg.k


def test_trained_folder_loads_in_saelens(tmp_path):
    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    windows = torch.randint(1, model.cfg.d_vocab, (24, 32), generator=torch.Generator().manual_seed(0))
    export_activations(model, windows, [HOOK], tmp_path / "acts", progress=False)
    recipe = SAERecipe(latents=96, k=8, tokens=20 * 32 * 2, batch_windows=4, eval_windows=4, lr=1e-3)
    ours = train_sae(tmp_path / "acts", HOOK, tmp_path / "sae", recipe, None, progress=False)
    _, cache = model.run_with_cache(windows[:2], [HOOK])
    same_codes(ours, tmp_path / "sae", cache[HOOK])


@pytest.mark.parametrize("name", sorted(EMBEDDED_SAES))
def test_shipped_sae_loads_in_saelens(name):
    from lenskit.saes.formats import embedded_sae_folder

    model = lenskit.HookedTransformer.from_pretrained("stdlib-gpt2")
    ours = SAE.load(name)
    _, cache = model.run_with_cache(model.to_tokens("import os\nprint(os.getcwd())\n"), [ours.hook_name])
    same_codes(ours, embedded_sae_folder(name), cache[ours.hook_name])
