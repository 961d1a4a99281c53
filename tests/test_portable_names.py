"""What lenskit writes names models and data the same way on every machine: the embedded models by their short
names, other folders by a relative path or their own name, data by paths relative to what was given, plus hashes;
never an absolute path of this machine."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model

import lenskit
from lenses import JacobianLens
from lenses.cli import main
from lenskit.io.data import read_documents

ROOT = Path(__file__).resolve().parents[1]
# An absolute POSIX path: a slash that starts a token, then a name and another slash.
ABSOLUTE = re.compile(r"(?<![\w.:/~-])/[\w.-]+/")


def absolute_paths(folder: Path, forbidden: list[str]) -> list[str]:
    """Every file under `folder` that names one of the `forbidden` paths, or any absolute path, with the match."""
    found = []
    for f in sorted(folder.rglob("*")):
        if f.suffix not in (".json", ".md"):
            continue
        text = f.read_text(encoding="utf-8")
        for bad in forbidden:
            if bad in text:
                found.append(f"{f.relative_to(folder)}: {bad}")
        found += [f"{f.relative_to(folder)}: {m.group(0)!r} in {text[max(0, m.start() - 40): m.end() + 40]!r}"
                  for m in ABSOLUTE.finditer(text)]
    return found


def test_the_embedded_models_are_named_by_their_short_names_however_they_are_loaded():
    for short, folder in lenskit.EMBEDDED_MODELS.items():
        assert lenskit.HookedTransformer.from_pretrained(folder).cfg.name == short
        assert lenskit.HookedTransformer.from_pretrained(short).cfg.name == short
    assert lenskit.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL).cfg.name == "stdlib-gpt2"


def test_other_folders_are_named_as_given_when_relative_and_by_their_name_when_absolute(tmp_path, monkeypatch):
    write_tiny_model(tmp_path / "models" / "tiny")
    assert lenskit.HookedTransformer.from_pretrained(tmp_path / "models" / "tiny").cfg.name == "tiny"
    monkeypatch.chdir(tmp_path)
    assert lenskit.HookedTransformer.from_pretrained("models/tiny").cfg.name == "models/tiny"


def test_data_provenance_names_files_relative_to_the_inputs(tmp_path, monkeypatch):
    corpus = write_text_folder(tmp_path / "corpus", n=3)
    _, absolute = read_documents([corpus])
    assert absolute["inputs"] == ["corpus"]
    assert [r["path"] for r in absolute["files"]] == [f"corpus/snippet_00{i}.py" for i in range(3)]
    monkeypatch.chdir(tmp_path)
    _, relative = read_documents(["corpus", str(corpus / "snippet_001.py")])
    assert relative["inputs"] == ["corpus", "corpus/snippet_001.py"]  # an absolute input below the working folder
    assert relative["files"][:3] == absolute["files"]
    # The data's hash is where it lies no more: the same files give the same sha256 from any folder.
    assert read_documents(["corpus"])[1]["sha256"] == absolute["sha256"]


@pytest.mark.slow
def test_no_absolute_path_in_any_card_or_config_a_tuned_and_a_jacobian_lens_write(tmp_path, capsys):
    model_folder = write_tiny_model(tmp_path / "model")
    data = write_text_folder(tmp_path / "train", n=20, seed=0)
    out = tmp_path / "tuned"
    assert main(["train-lens", "--model", str(model_folder), "--data", str(data), "--out", str(out),
                 "--steps", "2", "--tokens-per-step", "64", "--ctx", "16", "--quiet"]) == 0
    assert main(["eval-lens", "--model", str(model_folder), "--lens", str(out), "--data", str(data),
                 "--tokens", "128", "--ctx", "16", "--card", "--quiet"]) == 0
    assert main(["fit-jacobian", "--model", str(model_folder), "--data", str(data), "--out", str(tmp_path / "fitted"),
                 "--prompts", "2", "--tokens", "12", "--skip-first-positions", "2", "--streams", "1", "--quiet"]) == 0
    capsys.readouterr()

    model = lenskit.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)
    docs, provenance = read_documents([data])
    tokens = torch.tensor([model.tokenizer("".join(d.text for d in docs))["input_ids"][:24]])
    jacobian = tmp_path / "jacobian"
    JacobianLens.fit(model, tokens, skip_first_positions=2, streams=[model.cfg.n_layers - 1], progress=False,
                     out=jacobian, provenance=provenance)

    forbidden = sorted({str(tmp_path), str(Path.home()), str(ROOT), os.getcwd(), str(Path(lenskit.__file__).parent)},
                       key=len, reverse=True)
    assert absolute_paths(tmp_path / "tuned", forbidden) == []
    assert absolute_paths(jacobian, forbidden) == []
    assert absolute_paths(tmp_path / "fitted", forbidden) == []
    tuned_card, jacobian_card = (out / "README.md").read_text(), (jacobian / "README.md").read_text()
    assert "# Tuned lens for model" in tuned_card
    assert "# Jacobian lens for stdlib-gpt2" in jacobian_card
    assert 'from_pretrained("stdlib-gpt2")' in jacobian_card  # a snippet that runs on any machine
    config = json.loads((jacobian / "config.json").read_text())
    assert config["model_name"] == "stdlib-gpt2" and config["data"]["inputs"] == ["train"]
    assert torch.isfinite(JacobianLens.load(jacobian, model).matrix(model.cfg.n_layers - 1)).all()
