"""Bad input, as a table: each row names an input, what it must end in (an exception type, a CLI exit code,
or "works") and the words its one-line message must contain.

The last test runs every row and asserts that none ends in an exception type outside the table's promise
(a raw ZeroDivisionError, NotImplementedError, AttributeError, safetensors' own error, ...).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from bad_input_rows import (
    TRAIN,
    WORKS,
    Env,
    Row,
    check_bf16_readout,
    check_equal,
    check_few_bad,
    cli,
    cli_on_lens,
    cli_subprocess,
    drop_key,
    few_bad_bytes,
    fp32_lens_on_bf16,
    hook_to_half,
    lens_with_bytes,
    lens_with_config,
    load_lens,
    lock_released_on_interrupt,
    lock_twice,
    locked_by_live_process,
    locked_cli_run,
    model_with_config,
    model_with_weight,
    nan_lens,
    pickled_params,
    read_data,
    read_only_out,
    rerun_finished,
    same_as_long,
    saved_lens_modes,
    set_key,
    timed,
    truncated_checkpoint,
    truncated_model,
    with_nan,
)

import lenskit
from lenses import LogitLens
from lenses.training import CHECKPOINT_FILE, Recipe
from lenses.training.lock import LOCK_FILE, FolderLockedError
from lenses.tuned import TunedLens
from lenskit.intervene.interventions import Block, ablation_hooks
from lenskit.intervene.patching import logit_diff, patching_hooks
from lenskit.io.data import read_documents

ROWS = [
    # --------------------------------------------------------------- Recipe fields (issue 14, item 1)
    Row("recipe tokens_per_step -512", lambda e: Recipe(tokens_per_step=-512), ValueError, ("tokens_per_step", ">= 1", "-512")),
    Row("recipe tokens_per_step 0", lambda e: Recipe(tokens_per_step=0), ValueError, ("tokens_per_step", ">= 1")),
    Row("recipe ckpt_every 0", lambda e: Recipe(ckpt_every=0), ValueError, ("ckpt_every", ">= 1")),
    Row("recipe steps bool", lambda e: Recipe(steps=True), ValueError, ("steps", "integer", "True")),
    Row("recipe steps 0", lambda e: Recipe(steps=0), ValueError, ("steps", ">= 1")),
    Row("recipe ctx 1", lambda e: Recipe(ctx=1), ValueError, ("ctx", ">= 2")),
    Row("recipe lr 0", lambda e: Recipe(lr=0.0), ValueError, ("lr", "> 0")),
    Row("recipe lr nan", lambda e: Recipe(lr=float("nan")), ValueError, ("lr", "finite")),
    Row("recipe lr bool", lambda e: Recipe(lr=True), ValueError, ("lr",)),
    Row("recipe momentum 1", lambda e: Recipe(momentum=1.0), ValueError, ("momentum", "[0, 1)")),
    Row("recipe momentum -0.1", lambda e: Recipe(momentum=-0.1), ValueError, ("momentum",)),
    Row("recipe weight_decay -1", lambda e: Recipe(weight_decay=-1e-3), ValueError, ("weight_decay", ">= 0")),
    Row("recipe warmup -1", lambda e: Recipe(warmup_steps=-1), ValueError, ("warmup_steps", ">= 0")),
    Row("recipe clip 0", lambda e: Recipe(clip_grad_norm=0.0), ValueError, ("clip_grad_norm", "> 0")),
    Row("recipe seed str", lambda e: Recipe(seed="0"), ValueError, ("seed", "integer")),
    Row("recipe seed float", lambda e: Recipe(seed=1.5), ValueError, ("seed", "integer")),
    Row("recipe micro_batch_tokens 0", lambda e: Recipe(micro_batch_tokens=0), ValueError, ("micro_batch_tokens",)),
    Row("recipe optimizer", lambda e: Recipe(optimizer="rmsprop"), ValueError, ("optimizer", "'sgd' or 'adam'")),
    Row("recipe tokens_per_step not a multiple of ctx", lambda e: Recipe(tokens_per_step=100, ctx=16).resolve(10_000, 16),
        ValueError, ("tokens_per_step=100", "multiple of ctx")),
    Row("recipe ctx above n_ctx", lambda e: Recipe(ctx=999).resolve(10_000, 256), ValueError, ("ctx=999", "n_ctx=256")),
    Row("cli train-lens --tokens-per-step -512", cli_subprocess(*TRAIN, "--out", "{root}/rows/neg", "--tokens-per-step", "-512"),
        2, ("tokens_per_step", "--tokens-per-step", "-512")),
    Row("cli train-lens --tokens-per-step 0", cli_subprocess(*TRAIN, "--out", "{root}/rows/zero", "--tokens-per-step", "0"),
        2, ("--tokens-per-step", ">= 1")),
    Row("cli train-lens --ckpt-every 0", cli_subprocess(*TRAIN, "--out", "{root}/rows/ck0", "--ckpt-every", "0"),
        2, ("--ckpt-every", ">= 1")),
    Row("cli train-lens --lr -1", cli(*TRAIN, "--out", "{root}/rows/lr", "--lr", "-1"), 2, ("--lr", "> 0")),
    # --------------------------------------------------------------- output folder, lock, checkpoint (items 4-6)
    Row("train into a folder locked by a live run", locked_by_live_process, FolderLockedError,
        ("in use by another lenskit run", "pid", "--out")),
    Row("cli train-lens into a locked folder", locked_cli_run, 2, ("in use by another lenskit run",)),
    Row("lock the same folder twice", lock_twice, FolderLockedError, ("in use", str(os.getpid()))),
    Row("lock released on KeyboardInterrupt", lock_released_on_interrupt, WORKS,
        check=lambda e, out: None if not (out / LOCK_FILE).exists() else pytest.fail("lock left behind")),
    Row("--out under a file", cli(*TRAIN, "--out", "{root}/model/config.json/lens", "--steps", "2", "--tokens-per-step", "32"),
        2, ("is a file", "--out")),
    Row("train-lens rerun with another seed names that field alone", rerun_finished("reseed", "--seed", "7"), 2,
        ("belongs to a different run", "seed (saved 0, now 7) differ", "pass another --out")),
    Row("train-lens rerun with fewer steps than done", rerun_finished("fewer", "--steps", "1"), 2,
        ("2 steps done", "--steps 1", "pass --steps 2 or more")),
    Row("truncated checkpoint on resume", truncated_checkpoint, ValueError, ("corrupt", CHECKPOINT_FILE, "kept", "delete")),
    # --------------------------------------------------------------- token tensors and prompts (item 8)
    Row("int8 tokens", same_as_long(torch.int8), WORKS, check=check_equal),
    Row("uint8 tokens", same_as_long(torch.uint8), WORKS, check=check_equal),
    Row("int16 tokens", same_as_long(torch.int16), WORKS, check=check_equal),
    Row("uint16 tokens (nanoGPT's format)", same_as_long(torch.uint16), WORKS, check=check_equal),
    Row("int32 tokens", same_as_long(torch.int32), WORKS, check=check_equal),
    Row("token id past the vocabulary", lambda e: e.model(torch.tensor([[1, 300]])), ValueError, ("300", "outside the vocabulary")),
    Row("negative token id", lambda e: e.model(torch.tensor([[-1, 3]])), ValueError, ("-1", "outside the vocabulary")),
    Row("int8 negative token id", lambda e: e.model(torch.tensor([[5, -3]], dtype=torch.int8)), ValueError, ("-3", "outside")),
    Row("float tokens", lambda e: e.model(torch.tensor([[1.0, 2.0]])), TypeError, ("integer", "float32")),
    Row("bool tokens", lambda e: e.model(torch.tensor([[True]])), TypeError, ("integer", "bool")),
    Row("3-d tokens", lambda e: e.model(torch.zeros(1, 2, 3, dtype=torch.long)), ValueError, ("[batch, pos]",)),
    Row("no positions", lambda e: e.model(torch.zeros(1, 0, dtype=torch.long)), ValueError, ("pos >= 1",)),
    Row("longer than n_ctx", lambda e: e.model(torch.zeros(1, 65, dtype=torch.long)), ValueError, ("65 tokens", "n_ctx=64")),
    Row("list of ints", lambda e: e.model([1, 2, 3]), TypeError, ("LongTensor", "list")),
    Row("lone surrogate in a prompt", lambda e: e.model.to_tokens("def f\udcff():"), ValueError,
        ("not valid Unicode", "index 5", "UTF-8")),
    Row("empty prompt", lambda e: e.model.to_tokens(""), ValueError, ("empty", "prepend_bos")),
    Row("empty list of prompts", lambda e: e.model.to_tokens([]), ValueError, ("non-empty list",)),
    Row("cli lens with non-UTF-8 argv bytes", cli_subprocess("lens", b"x = \xff\xfe", "--model", "{root}/model"), 2,
        ("not valid Unicode", "command-line")),
    # --------------------------------------------------------------- model API (item 9)
    Row("generate max_new_tokens -5", lambda e: e.model.generate(e.tokens, max_new_tokens=-5), ValueError, ("max_new_tokens", ">= 0")),
    Row("generate max_new_tokens bool", lambda e: e.model.generate(e.tokens, max_new_tokens=True), ValueError, ("max_new_tokens",)),
    Row("stop_at_layer bool", lambda e: e.model(e.tokens, stop_at_layer=True), ValueError, ("stop_at_layer",)),
    Row("cache layer bool", lambda e: e.model.run_with_cache(e.tokens)[1]["resid_post", True], TypeError, ("layer", "True")),
    Row("lens layer bool", lambda e: LogitLens(e.model)(torch.zeros(1, 2, 32), True), TypeError, ("stream", "got bool")),
    Row("tuned lens mid layer bool",
        lambda e: TunedLens(e.model, resid_mid=True)(torch.zeros(1, 2, 32), lenskit.Stream(True, "resid_mid")),
        TypeError, ("layer", "True")),
    Row("ablate Block(True)", lambda e: ablation_hooks(e.model, [Block(True)]), TypeError, ("layer must be an int",)),
    Row("patching layer bool", lambda e: patching_hooks(e.model, e.model.run_with_cache(e.tokens)[1], "resid_pre", True),
        TypeError, ("layer", "True")),
    Row("logit_diff token past the vocabulary", lambda e: logit_diff(0, 10**6)(e.model(e.tokens)), ValueError,
        ("1000000", "outside the vocabulary")),
    Row("logit_diff negative token", lambda e: logit_diff(-1, 0), ValueError, (">= 0",)),
    # --------------------------------------------------------------- hooks
    Row("hook returns another dtype", hook_to_half, TypeError, ("to_half", "blocks.0.hook_resid_post", "float16", "float32")),
    Row("hook returns another shape", lambda e: e.model.run_with_hooks(e.tokens, fwd_hooks=[
        ("blocks.0.hook_resid_post", lambda x, hook: x[:, :1])]), ValueError, ("blocks.0.hook_resid_post", "shape")),
    Row("hook on an unknown name", lambda e: e.model.run_with_hooks(e.tokens, fwd_hooks=[("blocks.0.hook_resid_pots", print)]),
        KeyError, ("unknown hook name", "did you mean")),
    Row("hook that is not callable", lambda e: e.model.run_with_hooks(e.tokens, fwd_hooks=[("hook_embed", 3)]),
        TypeError, ("not callable",)),
    Row("fwd_hooks not pairs", lambda e: e.model.run_with_hooks(e.tokens, fwd_hooks=["hook_embed"]), TypeError, ("pairs",)),
    # --------------------------------------------------------------- data files (item 9)
    Row("binary data file", read_data("blob.txt", bytes(range(256)) * 8), ValueError, ("blob.txt", "not UTF-8 text", "binary")),
    Row("mostly undecodable data file", read_data("latin.txt", b"caf\xe9 " * 50), ValueError, ("latin.txt", "undecodable")),
    Row("a few undecodable bytes warn with a count", few_bad_bytes, WORKS, check=check_few_bad),
    Row("jsonl that is not UTF-8", read_data("bad.jsonl", b'{"text": "\xff\xff"}\n'), ValueError, ("bad.jsonl", "not UTF-8")),
    Row("jsonl with a bad line", read_data("broken.jsonl", b'{"text": "a"}\n{oops\n'), ValueError, ("broken.jsonl:2", "not valid JSON")),
    Row("missing data path", lambda e: read_documents([e.root / "nowhere"]), FileNotFoundError, ("does not exist",)),
    # --------------------------------------------------------------- model and lens folders
    Row("missing model folder", lambda e: lenskit.HookedTransformer.from_pretrained(e.root / "nowhere"), FileNotFoundError,
        ("no folder",)),
    Row("model folder without config.json", lambda e: lenskit.HookedTransformer.from_pretrained(e.path("empty_model").parent),
        FileNotFoundError, ("no config.json",)),
    Row("truncated model weights", truncated_model, ValueError, ("model.safetensors", "truncated or corrupt")),
    Row("lens folder that does not exist", lambda e: TunedLens.load(e.root / "nowhere", e.model), FileNotFoundError,
        ("no config.json", "TunedLens.save")),
    # --------------------------------------------------------------- lens folders (items 3, 6, 9)
    Row("load a truncated lens.safetensors", load_lens(lens_with_bytes("cut_lens", "lens.safetensors", lambda b: b[:300])),
        ValueError, ("lens.safetensors", "truncated or corrupt")),
    Row("lens --lens with a truncated lens.safetensors",
        cli_on_lens("lens", lens_with_bytes("cut_lens_cli", "lens.safetensors", lambda b: b[:300])), 2,
        ("lens.safetensors", "truncated or corrupt")),
    Row("eval-lens with a truncated lens.safetensors",
        cli_on_lens("eval-lens", lens_with_bytes("cut_lens_eval", "lens.safetensors", lambda b: b[:300])), 2,
        ("lens.safetensors", "truncated or corrupt")),
    Row("lens config.json that is a list", load_lens(lens_with_config("list_cfg", lambda c: [c])), ValueError,
        ("config.json", "JSON list", "object")),
    Row("lens --lens with a config.json that is a list", cli_on_lens("lens", lens_with_config("list_cfg_cli", lambda c: [c])),
        2, ("config.json", "JSON list")),
    Row('lens config "weights": null', load_lens(lens_with_config("null_weights", set_key("weights", None))), ValueError,
        ("config.json", "'weights'", "null", ".safetensors")),
    Row("lens config weights outside the folder", load_lens(lens_with_config("escape", set_key("weights", "../x.safetensors"))),
        ValueError, ("'weights'", "in the folder")),
    Row("lens config without model_fingerprint", load_lens(lens_with_config("no_fp", drop_key("model_fingerprint"))),
        ValueError, ("config.json", "no 'model_fingerprint'")),
    Row("eval-lens with a config without model_fingerprint",
        cli_on_lens("eval-lens", lens_with_config("no_fp_eval", drop_key("model_fingerprint"))), 2, ("'model_fingerprint'",)),
    Row("lens config that is bad JSON", load_lens(lens_with_bytes("bad_json", "config.json", lambda b: b[:-5])), ValueError,
        ("config.json", "not valid JSON", "line")),
    Row("lens --lens with bad JSON", cli_on_lens("lens", lens_with_bytes("bad_json_cli", "config.json", lambda b: b"{oops")), 2,
        ("config.json", "not valid JSON")),
    Row('lens config n_layers "6"', load_lens(lens_with_config("str_layers", set_key("n_layers", "6"))), ValueError,
        ("'n_layers'", "integer", '"6"')),
    Row("lens config n_layers true", load_lens(lens_with_config("bool_layers", set_key("n_layers", True))), ValueError,
        ("'n_layers'", "integer", "true")),
    Row('lens config resid_mid "no"', load_lens(lens_with_config("str_mid", set_key("resid_mid", "no"))), ValueError,
        ("'resid_mid'", "true or false")),
    Row("lens config from a newer format", load_lens(lens_with_config("newer", set_key("format_version", 99))), ValueError,
        ("format_version 99", "upgrade lenskit")),
    Row("lens with NaN or inf weights", nan_lens, ValueError, ("translators.1.weight", "NaN or inf")),
    Row("tuned-lens params.pt holding a pickle payload", pickled_params, ValueError,
        ("params.pt", "not a plain tensor file", "nothing in it was executed")),
    Row("float32 lens on the same model in bfloat16", fp32_lens_on_bf16, WORKS, check=check_bf16_readout),
    Row("lens files get the umask's permissions, not 0600", saved_lens_modes, WORKS,
        check=lambda e, modes: None if set(modes.values()) == {0o644} else pytest.fail(f"modes {modes}")),
    # --------------------------------------------------------------- model configs and weights (items 3, 7, 9)
    Row("model config n_embd [192]", model_with_config("cfg_list", n_embd=[192]), ValueError, ("n_embd",)),
    Row("model config n_layer 6.7", model_with_config("cfg_float", n_layer=6.7), ValueError, ("n_layer", "6.7")),
    Row('model config tie_word_embeddings "false"', model_with_config("cfg_tie", tie_word_embeddings="false"), ValueError,
        ("tie_word_embeddings",)),
    Row("model config n_layer true", model_with_config("cfg_bool", n_layer=True), ValueError, ("n_layer",)),
    Row('model config layer_norm_epsilon "abc"', model_with_config("cfg_eps", layer_norm_epsilon="abc"), ValueError,
        ("layer_norm_epsilon",)),
    Row("model config n_layer 3000 fails fast", timed(model_with_config("cfg_deep", n_layer=3000), 10.0), ValueError,
        ("missing",)),
    Row("model with a NaN weight", model_with_weight("nan_model", with_nan), ValueError, ("ln_f.weight", "NaN or inf")),
    Row("model with int32 weights", model_with_weight("int_model", lambda w: w.to(torch.int32)), ValueError,
        ("ln_f.weight", "int32", "floating point")),
    Row('from_pretrained(dtype="float16")', lambda e: lenskit.HookedTransformer.from_pretrained(e.root / "model", dtype="float16"),
        WORKS, check=lambda e, m: None if m.unembed.weight.dtype == torch.float16 else pytest.fail(str(m.unembed.weight.dtype))),
    # --------------------------------------------------------------- CLI arguments (item 9)
    Row("ablate --out with an unknown suffix, before any work",
        cli("ablate", "x = 1", "--block", "0", "--model", "{root}/nowhere", "--out", "{root}/fig.txt"), 2,
        ("cannot tell the format", "fig.txt")),
    Row("eval-lens --ctx 999", cli("eval-lens", "--model", "{root}/model", "--lens", "{root}/lens", "--data", "{root}/data",
                                   "--ctx", "999", "--quiet"), 2, ("ctx=999", "n_ctx=64", "--ctx")),
    Row("lens --lens that is not a folder", cli("lens", "x = 1", "--model", "{root}/model", "--lens", "{root}/nowhere"), 2,
        ("no such folder or file, and not a lens kind",)),
    Row("ablate with nothing to ablate", cli("ablate", "x = 1", "--model", "{root}/model"), 2, ("nothing to ablate",)),
    Row("ablate an out-of-range block", cli("ablate", "x = 1", "--model", "{root}/model", "--block", "9"), 2, ("out of range",)),
]
if os.name != "nt" and os.geteuid() != 0:  # root may write anywhere, so the check cannot fail there
    ROWS.append(Row("read-only --out parent", read_only_out, 2, ("cannot write", "permission denied", "--out")))

# What a row may end in: the documented one-line error types. Anything else is a defect in itself.
USER_ERRORS = (ValueError, TypeError, KeyError, IndexError, OSError)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    return Env(tmp_path_factory.mktemp("bad_input"))


def outcome(env: Env, row: Row) -> tuple[str, Any]:
    """("raised", exception) | ("exit", (code, stderr)) | ("returned", value); each row runs once per session."""
    if row.name not in env.outcomes:
        try:
            value = row.run(env)
        except Exception as e:  # noqa: BLE001 - the table decides what was allowed
            env.outcomes[row.name] = ("raised", e)
        else:
            is_cli = isinstance(row.expect, int) and not isinstance(row.expect, bool)
            env.outcomes[row.name] = ("exit", value) if is_cli else ("returned", value)
    return env.outcomes[row.name]


def test_row_names_are_unique():
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("row", [pytest.param(row, marks=[pytest.mark.slow] if getattr(row.run, "slow", False) else [])
                                 for row in ROWS], ids=[row.name for row in ROWS])
def test_row(env, row):
    kind, value = outcome(env, row)
    if row.expect == WORKS:
        assert kind == "returned", f"{row.name}: raised {type(value).__name__}: {value}"
        if row.check is not None:
            row.check(env, value)
        return
    if isinstance(row.expect, int):
        assert kind == "exit", f"{row.name}: raised {type(value).__name__}: {value}"
        code, stderr = value
        assert code == row.expect, stderr
        assert "Traceback" not in stderr, stderr
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
        message = lines[0]
    else:
        assert kind == "raised", f"{row.name}: expected {row.expect.__name__}, but it {kind} {value!r:.200}"
        assert isinstance(value, row.expect), f"{row.name}: expected {row.expect.__name__}, got {type(value).__name__}: {value}"
        message = value.args[0] if isinstance(value, KeyError) and value.args else str(value)
        assert "\n" not in message.strip(), message
    for word in row.words:
        assert word in message, f"{row.name}: {word!r} is not in the message: {message}"


@pytest.mark.slow  # runs the subprocess rows too
def test_no_row_ends_in_an_unexpected_exception_type(env):
    unexpected = []
    for row in ROWS:
        kind, value = outcome(env, row)
        if kind == "raised" and not isinstance(value, USER_ERRORS):
            unexpected.append(f"{row.name}: {type(value).__name__}: {value}")
        if kind == "exit" and "Traceback" in value[1]:
            unexpected.append(f"{row.name}: a traceback on stderr")
    assert not unexpected, "\n".join(unexpected)
