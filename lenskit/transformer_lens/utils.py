"""`transformer_lens.utils`: TransformerLens 3's utility functions under their names and argument orders.

Most are re-exports of lenskit (`get_act_name`, `Slice`, the losses of `lenskit.losses`) or a few lines of tensor
bookkeeping; `test_prompt` prints TransformerLens's report on a prompt and its answer. Dataset downloads
(`get_dataset`, `download_file_from_hf`) are not here: nothing in this namespace reaches the network.

>>> from lenskit.transformer_lens import utils
>>> utils.get_act_name("resid_pre", 3)
'blocks.3.hook_resid_pre'
>>> utils.test_prompt("import os\\nos.path.", "join", model, prepend_space_to_answer=False)
Tokenized prompt: ['import', ' os', '\\n', 'os', '.', 'path', '.']
Tokenized answer: ['join']
Performance on answer token:
Rank: 0        Logit:  8.44 Prob: 24.22% Token: |join|
Top 0th token. Logit:  8.44 Prob: 24.22% Token: |join|
Top 1th token. Logit:  8.08 Prob: 16.87% Token: |is|
...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from lenskit.config import GELU_ACTIVATIONS
from lenskit.factored import FactoredMatrix
from lenskit.losses import next_token_accuracy, next_token_loss
from lenskit.observe.names import get_act_name
from lenskit.observe.slices import Slice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["USE_DEFAULT_VALUE", "Slice", "composition_scores", "gelu_fast", "gelu_new", "get_act_name", "get_corner",
           "get_device", "get_tokens_with_bos_removed", "is_lower_triangular", "is_square", "keep_single_column", "lm_accuracy",
           "lm_cross_entropy_loss", "print_gpu_mem", "remove_batch_dim", "solu", "test_prompt", "to_numpy",
           "tokenize_and_concatenate", "transpose"]


# An argument left at this value takes the model's own default (`prepend_bos=`, `padding_side=`): None, as there.
USE_DEFAULT_VALUE = None


# ------------------------------------------------------------------ tensors
def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a tensor (detached, on the CPU; bfloat16 widened to float32, which numpy lacks), a list,
    a tuple, a numpy array or a Python scalar."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    if isinstance(tensor, (list, tuple, int, float, bool, str)):
        return np.array(tensor)
    raise TypeError(f"to_numpy takes a tensor, numpy array, list, tuple or scalar, got {type(tensor).__name__}")


def get_corner(tensor: Any, n: int = 3) -> Any:
    """The first n entries along every axis: `tensor[:n, :n, ...]` (a tensor, array or FactoredMatrix)."""
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def remove_batch_dim(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` without its first axis where that axis has size 1; otherwise `tensor` itself."""
    return tensor.squeeze(0) if tensor.ndim > 0 and tensor.shape[0] == 1 else tensor


def transpose(tensor: torch.Tensor) -> torch.Tensor:
    """[..., a, b] -> [..., b, a]."""
    return tensor.transpose(-1, -2)


def is_square(x: torch.Tensor) -> bool:
    """Whether x is a 2-d square matrix."""
    return x.ndim == 2 and x.shape[0] == x.shape[1]


def is_lower_triangular(x: torch.Tensor) -> bool:
    """Whether x is a square matrix with only zeros above its diagonal."""
    return is_square(x) and bool(x.equal(x.tril()))


def get_device() -> torch.device:
    """`torch.device("cuda")` where a GPU is available, else the CPU. (Apple's MPS is not chosen for you: pass
    it yourself, as TransformerLens 4 asks too.)"""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def print_gpu_mem(step_name: str = "") -> None:
    """Print the GiB that torch has allocated on the current GPU."""
    print(f"{step_name} ~ {torch.cuda.memory_allocated() / 2 ** 30:.2f} GiB allocated on GPU.")


# ------------------------------------------------------------------ activations
def gelu_new(input: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): torch's tanh GELU, as lenskit's MLPs run it."""
    return F.gelu(input, approximate=GELU_ACTIVATIONS["gelu_new"])


def gelu_fast(input: torch.Tensor) -> torch.Tensor:
    """The same tanh approximation of GELU as `gelu_new` (its constants written out differently)."""
    return F.gelu(input, approximate=GELU_ACTIVATIONS["gelu_fast"])


def solu(input: torch.Tensor) -> torch.Tensor:
    """SoLU, x * softmax(x) over the last axis (the LayerNorm that follows it is the MLP's)."""
    return input * input.softmax(dim=-1)


# ------------------------------------------------------------------ losses
def lm_cross_entropy_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          per_token: bool = False) -> torch.Tensor:
    """Next-token cross-entropy of logits [batch, pos, d_vocab] against tokens [batch, pos]: the mean (a scalar),
    or with `per_token` each prediction's [batch, pos - 1]; `attention_mask` [batch, pos] drops padded
    predictions (`lenskit.losses.next_token_loss`)."""
    return next_token_loss(logits, tokens, attention_mask, per_token)


def lm_accuracy(logits: torch.Tensor, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Top-1 next-token accuracy: the fraction of positions whose argmax is the next token, or with `per_token`
    bool [batch, pos - 1] (`lenskit.losses.next_token_accuracy`)."""
    return next_token_accuracy(logits, tokens, per_token)


# ------------------------------------------------------------------ factored matrices
def composition_scores(left: FactoredMatrix, right: FactoredMatrix, broadcast_dims: bool = True) -> torch.Tensor:
    """||left @ right||_F / (||left||_F ||right||_F), from the factors (no product is formed).

    With `broadcast_dims`, every left matrix is scored against every right one: left [*L, a, b] and right
    [*R, b, c] give [*L, *R]; without it their leading dims broadcast as in a product.

    >>> composition_scores(model.OV[0], model.QK[1]).shape   # [head, head]: heads of layer 0 feeding queries in layer 1
    torch.Size([6, 6])
    """
    if broadcast_dims:
        n_left, n_right = left.ndim - 2, right.ndim - 2
        for _ in range(n_right):
            left = left.unsqueeze(n_left)  # [*L, 1.., a, b]
        for i in range(n_left):
            right = right.unsqueeze(i)  # [1.., *R, b, c]
    if left.rdim != right.ldim:
        raise ValueError(f"composition needs left's columns to match right's rows: left {tuple(left.shape)}, "
                         f"right {tuple(right.shape)}")
    lhs, rhs = left.collapse_l(), right.collapse_r()  # [..., k, b], [..., b, k']: same norms, fewer rows
    return (lhs @ rhs).norm(dim=(-2, -1)) / lhs.norm(dim=(-2, -1)) / rhs.norm(dim=(-2, -1))


# ------------------------------------------------------------------ exploring a prompt
def test_prompt(prompt: str, answer: str | Sequence[str], model: Any, prepend_space_to_answer: bool = True,
                print_details: bool = True, prepend_bos: bool | None = None, top_k: int = 10) -> None:
    """Print how `model` does on `answer` after `prompt`: the tokenized prompt and answer, then for each answer
    token its rank, logit and probability and the top_k tokens there, then the ranks. Returns None.

    `answer` is one string (each of its tokens is scored in turn) or a list of strings (only their first
    tokens are scored, side by side). `prepend_space_to_answer` puts a space before an answer that has none;
    `prepend_bos` applies to the prompt, as in `model.to_tokens`.

    >>> test_prompt("def __init__(self, name):\\n    self.name =", " name", model, top_k=2)
    Tokenized prompt: ['def', ' __', 'init', '__(', 'self', ',', ' name', '):', '\\n   ', ' self', '.', 'name', ' =']
    Tokenized answer: [' name']
    Performance on answer token:
    Rank: 4        Logit:  7.63 Prob:  5.54% Token: | name|
    Top 0th token. Logit:  8.35 Prob: 11.39% Token: | _|
    Top 1th token. Logit:  7.73 Prob:  6.12% Token: | self|
    Ranks of the answer tokens: [(' name', 4)]
    """
    answers = [answer] if isinstance(answer, str) else list(answer)
    if not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"answer must be a string or a non-empty list of strings, got {answer!r:.80}")
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    several = len(answers) > 1
    prompt_ids = model.to_tokens(prompt, prepend_bos=prepend_bos)[0]  # [prompt_pos]
    answer_ids = [model.to_tokens(a, prepend_bos=False)[0] for a in answers]  # each [answer_pos]
    answer_ids = [ids[:1] for ids in answer_ids] if several else answer_ids  # several answers: their first tokens
    rows = torch.stack([torch.cat([prompt_ids, ids]) for ids in answer_ids])  # [answer, pos]
    prompt_text = model.to_str_tokens(prompt_ids)
    answer_texts = [model.to_str_tokens(ids) for ids in answer_ids]  # each [answer_pos] strings
    if print_details:
        print("Tokenized prompt:", prompt_text)
        print("Tokenized answers:" if several else "Tokenized answer:", answer_texts if several else answer_texts[0])
    with torch.no_grad():
        logits = model(rows)  # [answer, pos, d_vocab]
    probs = logits.float().softmax(dim=-1)
    ranks = []
    for step in range(len(answer_ids[0])):
        at = len(prompt_ids) + step - 1  # the position that predicts answer token `step`
        ids = rows[:, at + 1]  # [answer]
        here = probs[torch.arange(len(answers)), at, ids]  # [answer]
        rank = (probs[:, at] > here[:, None]).sum(dim=-1)  # [answer]: tokens more likely than the answer
        ranks.append([(texts[step], int(r)) for texts, r in zip(answer_texts, rank)])
        if print_details:
            print(f"Performance on answer token{'s' if several else ''}:")
            for i in range(len(answers)):
                print(f"Rank: {int(rank[i]): <8} Logit: {logits[i, at, ids[i]].item():5.2f} Prob: {here[i].item():6.2%} "
                      f"Token: |{answer_texts[i][step]}|")
            top = probs[0, at].topk(top_k)
            for i, (p, tok) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                print(f"Top {i}th token. Logit: {logits[0, at, tok].item():5.2f} Prob: {p:6.2%} "
                      f"Token: |{model.to_string(torch.tensor(tok))}|")
    print("Ranks of the answer tokens:", ranks if several else [r[0] for r in ranks])


test_prompt.__test__ = False  # type: ignore[attr-defined]  # not a test, for pytest, in a test module that imports it by name


def get_tokens_with_bos_removed(tokenizer: "PreTrainedTokenizerBase", tokens: torch.Tensor) -> torch.Tensor:
    """Token rows [batch, pos] that start with BOS -> the rows without it [batch, pos - 1].

    Right-padded rows lose their first column. Left-padded rows (`tokenizer.padding_side == "left"`) lose the BOS
    after their padding, and keep their padding on the left; where the pad id is the BOS id, a row's BOS is the last
    of its leading run of that id.
    """
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    if bos is None:
        raise ValueError("get_tokens_with_bos_removed needs a tokenizer with a bos_token_id")
    if getattr(tokenizer, "padding_side", "right") != "left" or pad is None:
        return tokens[..., 1:]
    flat = tokens.reshape(-1, tokens.shape[-1])  # [row, pos]
    lead = (flat == pad).int().cumprod(dim=-1).sum(dim=-1)  # [row]: the leading pad-id run
    at = lead - 1 if pad == bos else lead  # [row]: where each row's BOS is
    if bool(((at < 0) | (at >= flat.shape[-1])).any()) or not bool((flat.gather(1, at[:, None]) == bos).all()):
        raise ValueError("get_tokens_with_bos_removed: a left-padded row has no BOS after its padding")
    keep = torch.ones_like(flat, dtype=torch.bool).scatter_(1, at[:, None], False)
    return flat[keep].reshape(*tokens.shape[:-1], tokens.shape[-1] - 1)


# ------------------------------------------------------------------ datasets
def keep_single_column(dataset: Any, col_name: str) -> Any:
    """A Hugging Face `datasets` dataset with every column but `col_name` removed."""
    names = dataset.column_names or []  # None for a streamed dataset whose features are not known yet
    return dataset.remove_columns([c for c in names if c != col_name])


def tokenize_and_concatenate(dataset: Any, tokenizer: "PreTrainedTokenizerBase", streaming: bool = False,
                             max_length: int = 1024, column_name: str = "text", add_bos_token: bool = True,
                             num_proc: int | None = 10) -> Any:
    """A `datasets` Dataset of text -> one of token rows: column "tokens", each row [max_length] ids.

    The texts of each `map` batch (1,000 documents) are tokenized one by one (no special tokens), joined with the
    EOS id between them, and cut into rows of max_length (max_length - 1 and BOS first with `add_bos_token`);
    the tokens left over at a batch's end are dropped, and a batch shorter than one row is padded (the pad id,
    else EOS) to one. `num_proc` processes tokenize (None: this one; ignored when `streaming`). The result is
    in torch format. The tokenizer is not changed.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenize_and_concatenate joins documents with EOS, but the tokenizer has no eos_token_id")
    bos = tokenizer.bos_token_id
    if add_bos_token and bos is None:
        raise ValueError("add_bos_token=True but the tokenizer has no bos_token_id; pass add_bos_token=False")
    if dataset.column_names is not None and column_name not in dataset.column_names:
        raise ValueError(f"the dataset has no column {column_name!r} (columns: {dataset.column_names}); pass column_name=")
    valid = isinstance(max_length, int) and not isinstance(max_length, bool)
    width = max_length - 1 if valid and add_bos_token else max_length if valid else 0
    if width < 1:
        raise ValueError(f"max_length must be an int of at least {2 if add_bos_token else 1} (a row holds BOS "
                         f"only with add_bos_token), got {max_length!r}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def rows(batch: dict[str, list[str]]) -> dict[str, np.ndarray]:
        docs = tokenizer(batch[column_name], add_special_tokens=False)["input_ids"] if batch[column_name] else []
        stream: list[int] = []
        for i, ids in enumerate(docs):
            stream += ([tokenizer.eos_token_id] if i else []) + list(ids)
        if not stream:
            return {"tokens": np.zeros((0, max_length), dtype=np.int64)}
        n_rows = max(len(stream) // width, 1)
        stream = (stream + [pad] * width)[: n_rows * width]  # pads only a stream shorter than one row
        out = np.asarray(stream, dtype=np.int64).reshape(n_rows, width)  # [row, width]
        if add_bos_token:
            out = np.concatenate([np.full((n_rows, 1), bos, dtype=np.int64), out], axis=1)  # [row, max_length]
        return {"tokens": out}

    dataset = keep_single_column(dataset, column_name)
    parallel = {} if streaming else {"num_proc": num_proc}
    tokens = dataset.map(rows, batched=True, remove_columns=[column_name], **parallel)
    return tokens.with_format("torch") if streaming else tokens.with_format("torch", columns=["tokens"])
