"""The tokenizer comes from the checkpoint's own files: `tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt`.

Those files are a user's: each is checked to be a regular file, and anything the `tokenizers` library
raises while reading them or while encoding with them (its Rust errors are bare `Exception`s, and a Rust
panic is pyo3's `PanicException`, a `BaseException`) comes out as one ValueError naming the file.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .files import check_regular_file, read_json_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Every file of a tokenizer folder that transformers may open when it loads one of the classes below.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
# The settings files beside it, each a small JSON object.
SMALL_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.json")
# The largest real tokenizer.json files (Gemma's) are about 35 MB.
TOKENIZER_MAX_BYTES = 1 << 30


def has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").exists() or ((folder / "vocab.json").exists() and (folder / "merges.txt").exists())


def is_library_failure(e: BaseException) -> bool:
    """An error raised inside the Rust of `tokenizers`: a bare Exception (its own errors) or pyo3's PanicException
    (a Rust panic, e.g. a regex that runs past its retry limit), which derives from BaseException only."""
    return type(e) is Exception or type(e).__name__ == "PanicException"


def _detail(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_tokenizer(folder: str | Path) -> "PreTrainedTokenizerBase | None":
    """The fast tokenizer of `folder` (its `tokenizer.json` as written, pre- and post-processing included,
    so a Llama 3 tokenizer adds its BOS as it does in transformers), GPT-2's BPE from `vocab.json` +
    `merges.txt` when there is no `tokenizer.json`, or None when the folder carries no tokenizer files.
    Files that cannot be read are one ValueError (or NotARegularFileError) naming the file."""
    folder = Path(folder)
    if not has_tokenizer_files(folder):
        return None
    for name in TOKENIZER_FILES:
        if os.path.lexists(folder / name):
            st = check_regular_file(folder / name, "a tokenizer file")
            if st.st_size > TOKENIZER_MAX_BYTES:
                raise ValueError(f"{folder / name} is {st.st_size:,} bytes, more than the {TOKENIZER_MAX_BYTES:,} a "
                                 "tokenizer file may hold; is it the right file?")
    for name in SMALL_JSON_FILES:  # bounded here; transformers then reads them without a bound
        if (folder / name).exists():
            read_json_object(folder / name, what=f"a tokenizer's {name} (a JSON object)")
    uses_json = (folder / "tokenizer.json").exists()
    if uses_json:
        source, expected = folder / "tokenizer.json", ("a tokenizers tokenizer.json (a BPE, WordPiece, WordLevel or "
                                                       "Unigram model, as tokenizers or save_pretrained write it)")
    else:
        vocab = read_json_object(folder / "vocab.json", what="GPT-2's vocab.json (a JSON object of token -> id)")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
            raise ValueError(f"{folder / 'vocab.json'} maps a token to something that is not an integer id; "
                             "expected GPT-2's vocab.json (a JSON object of token -> id)")
        source, expected = folder / "merges.txt", "GPT-2's merges.txt (one merge, two tokens, per line) beside vocab.json"
    from transformers import GPT2Tokenizer, PreTrainedTokenizerFast  # imported here: seconds, and only to load

    # Name the class: AutoTokenizer would follow whatever tokenizer_config.json says (and may run code).
    cls = PreTrainedTokenizerFast if uses_json else GPT2Tokenizer
    try:
        return cls.from_pretrained(str(folder), local_files_only=True)
    except BaseException as e:
        if isinstance(e, RecursionError):  # transformers parses tokenizer.json itself, with no depth bound
            detail = "nests JSON too deeply to parse"
        elif isinstance(e, UnicodeDecodeError):
            detail = f"not UTF-8 text ({e.reason} at byte {e.start})"
        elif isinstance(e, (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError)) or is_library_failure(e):
            detail = _detail(e)
        else:
            raise
        name = source.name if uses_json or "erges" in detail else "vocab.json + merges.txt"
        raise ValueError(f"the tokenizer files in {folder} could not be read: {name}: {detail}; expected {expected}") from None


@contextlib.contextmanager
def tokenizer_failures(tokenizer: "PreTrainedTokenizerBase", doing: str = "encoding text") -> Iterator[None]:
    """Turn a failure inside `tokenizers` (see `is_library_failure`) while `doing` into one ValueError that
    names the tokenizer's files; anything else passes through.

    >>> tok = model.tokenizer
    >>> with tokenizer_failures(tok):
    ...     ids = tok.encode("def f(x):", add_special_tokens=False)
    >>> tok.convert_ids_to_tokens(ids)
    ['def', 'Ġf', '(', 'x', '):']
    """
    try:
        yield
    except BaseException as e:
        if not is_library_failure(e):
            raise
        where = getattr(tokenizer, "name_or_path", "") or "in memory"
        hint = ("its pre-tokenizer regex (tokenizer.json) backtracks past the regex engine's retry limit on this "
                "text: fix the pattern, or pass shorter text" if "retry-limit" in str(e) else
                "the tokenizer files may be corrupt, or not made for this version of tokenizers")
        raise ValueError(f"the tokenizer ({where}) failed while {doing}: {_detail(e)}; {hint}") from None


def save_tokenizer(tokenizer: "PreTrainedTokenizerBase", folder: str | Path) -> None:
    """`tokenizer.json` plus GPT-2's classic `vocab.json` and `merges.txt`, so older readers work too."""
    tokenizer.save_pretrained(str(folder))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        backend.model.save(str(folder))
