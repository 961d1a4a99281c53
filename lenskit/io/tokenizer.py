"""The tokenizer comes from the checkpoint's own files: `tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt`."""

from __future__ import annotations

from pathlib import Path

from transformers import GPT2Tokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").exists() or ((folder / "vocab.json").exists() and (folder / "merges.txt").exists())


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase | None:
    """The fast tokenizer of `folder` (its `tokenizer.json` as written, pre- and post-processing included,
    so a Llama 3 tokenizer adds its BOS as it does in transformers), GPT-2's BPE from `vocab.json` +
    `merges.txt` when there is no `tokenizer.json`, or None when the folder carries no tokenizer files."""
    folder = Path(folder)
    if not has_tokenizer_files(folder):
        return None
    # Name the class: AutoTokenizer would follow whatever tokenizer_config.json says (and may run code).
    cls = PreTrainedTokenizerFast if (folder / "tokenizer.json").exists() else GPT2Tokenizer
    try:
        return cls.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the tokenizer files in {folder} could not be read: {e}") from e


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> None:
    """`tokenizer.json` plus GPT-2's classic `vocab.json` and `merges.txt`, so older readers work too."""
    tokenizer.save_pretrained(str(folder))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        backend.model.save(str(folder))
