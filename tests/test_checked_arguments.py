"""Arguments checked, not coerced, and a dependency's exception turned into one line naming the file, hook or argument
(issue 40, items 6 and 8): expert, head, neuron and position indices; modes and hook directions; a MoE hook's indices;
a hook pair cut in two; Gemma 4's counts; truncated shards; apply_ln_to_stack's stack; a patching metric; dtype
conversions that overflow."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from families import build_family_model, family_model_of

from lenses.cli import main
from lenskit import HookedTransformer
from lenskit.intervene.attribution import attribution_patching
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.intervene.interventions import Head, Mlp, Neurons, ablation_hooks
from lenskit.intervene.patching import activation_patching, patching_hooks
from lenskit.io.loading import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tokens(pos: int = 6) -> torch.Tensor:
    return torch.randint(1, 300, (2, pos), generator=torch.Generator().manual_seed(0))


def one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    """Saved tiny models (config, weights, tokenizer) of a dense, a MoE and a Gemma 4 family."""
    out = {}
    for family in ("llama", "mixtral", "gemma4_text"):
        folder = tmp_path_factory.mktemp(family)
        build_family_model(family).model.save_pretrained(folder)
        out[family] = folder
    return out


# ------------------------------------------------------------------------------------------ indices
BAD_INDICES = [1.9, True, "1", 1.0, np.float32(2.0), torch.tensor([1.5])]


@pytest.mark.parametrize("bad", BAD_INDICES, ids=[repr(b) for b in BAD_INDICES])
def test_an_index_that_is_not_an_integer_is_refused_not_rounded(bad):
    """`1.9` or `True` as an expert used to mean expert 1."""
    model = family_model_of("mixtral").model
    calls = {
        "experts": lambda: Expert(1, bad),
        "experts": lambda: Expert(1, [0, bad]),  # noqa: F601 - in a list too
        "heads": lambda: Head(0, bad),
        "neurons": lambda: Neurons(0, [bad]),
        "positions": lambda: ablation_hooks(model, [Mlp(0)], positions=bad),
    }
    calls["expert positions"] = lambda: expert_ablation_hooks(model, Expert(0, 1), positions=[bad])
    calls["patch heads"] = lambda: patching_hooks(model, {}, "head", 0, heads=bad)
    for call in calls.values():
        with pytest.raises(TypeError) as err:
            call()
        one_line(err, "must be integers, got")


def test_integer_kinds_other_than_int_are_taken():
    assert Expert(0, np.int64(2)).experts == (2,)
    assert Expert(0, torch.tensor([1, 3])).experts == (1, 3)
    assert Head(1, [np.int32(0), 1]).heads == (0, 1)


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("returned, error, words", [
    (lambda x: x - x - 1, ValueError, "expert indices must lie in [0, "),  # -1: torch's bincount error before
    (lambda x: x * 0 + 99, ValueError, "expert indices must lie in [0, "),  # past the experts
    (lambda x: x.float(), TypeError, "returned dtype torch.float32, but the activation is torch.int64"),
])
def test_a_hook_returning_bad_expert_indices_is_refused_before_bincount(family, returned, error, words):
    model = family_model_of(family).model
    layer = next(i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i))
    with pytest.raises(error) as err:
        model.run_with_hooks(tokens(), fwd_hooks=[(f"blocks.{layer}.mlp.hook_expert_indices", lambda x, hook: returned(x))])
    one_line(err, words, "hook_expert_indices")
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


def test_an_expert_ablation_hook_list_cut_in_two_says_so():
    model = family_model_of("mixtral").model
    hooks = expert_ablation_hooks(model, Expert(1, 0))
    assert len(hooks) == 2
    with pytest.raises(RuntimeError) as err:
        model.run_with_hooks(tokens(), fwd_hooks=hooks[1:])  # was "pop from empty list"
    one_line(err, "blocks.1.mlp.hook_expert_weights", "hook_expert_indices did not run", "pass both hooks")


# ------------------------------------------------------------------------------------------ hook directions
def test_a_backward_hook_on_an_integer_hook_point_is_refused():
    """No gradient reaches expert indices, so the hook could never fire."""
    model = family_model_of("mixtral").model
    name = "blocks.0.mlp.hook_expert_indices"
    calls = [
        lambda: model.add_hook(name, lambda g, hook: None, dir="bwd"),
        lambda: model.hooks(bwd_hooks=[(name, lambda g, hook: None)]).__enter__(),
        lambda: model.run_with_hooks(tokens(), bwd_hooks=[(name, lambda g, hook: None)], reset_hooks_end=False),
    ]
    for call in calls:
        with pytest.raises(ValueError) as err:
            call()
        one_line(err, name, "carries integers, which have no gradient")
    assert not any(hp.has_hooks(including_permanent=True) for hp in model.hook_dict.values())
    # A predicate passes over them: a backward hook "everywhere" still runs wherever a gradient arrives.
    seen = []
    with model.hooks(bwd_hooks=[(lambda n: n.startswith("blocks.0.mlp."), lambda g, hook: seen.append(hook.name))]):
        model(tokens(), return_type="loss").backward()
    assert seen and name not in seen
    model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------ modes, CLI
def test_ablate_with_experts_only_refuses_a_mode_it_would_not_run(folders, capsys):
    """`--mode mean` with only `--expert` silently ran zero mode."""
    for mode in ("mean", "resample"):
        assert main(["ablate", "a b c", "--model", str(folders["mixtral"]), "--expert", "1.0", "--mode", mode]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--mode {mode} applies to --block, --attn, --mlp and --head" in err and len(err.splitlines()) == 1, err
    assert main(["ablate", "a b c", "--model", str(folders["mixtral"]), "--expert", "1.0"]) == 0


@pytest.mark.parametrize("spec", ["1.9", "1.x", "1.True", "1.-1"])
def test_ablate_refuses_a_malformed_or_out_of_range_expert(folders, capsys, spec):
    try:  # argparse's own usage error exits; lenskit's returns 2
        code = main(["ablate", "a b c", "--model", str(folders["mixtral"]), "--expert", spec])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and "expert" in err.splitlines()[-1], err


# ------------------------------------------------------------------------------------------ configs and files
@pytest.mark.parametrize("field, value", [("num_kv_shared_layers", -1), ("num_kv_shared_layers", -5),
                                          ("hidden_size_per_layer_input", -8)])
def test_a_negative_gemma4_count_is_refused_by_name_in_the_cli(folders, tmp_path, capsys, field, value):
    folder = tmp_path / "g"
    folder.mkdir()
    for f in folders["gemma4_text"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    for command in (["info", "--model", str(folder)], ["lens", "a b", "--model", str(folder)]):
        assert main(command) == 2  # was an IndexError traceback
        err = capsys.readouterr().err.strip()
        assert f"{field}={value} must be an integer >= 0" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("cut", [lambda b: b[:-64], lambda b: b[:5], lambda b: b[:8] + b"{" * 40])
def test_a_truncated_shard_is_one_line_naming_it(folders, tmp_path, capsys, family, cut):
    source = build_family_model(family).hf
    source.save_pretrained(tmp_path, max_shard_size="20KB")
    for f in folders[family].iterdir():
        if f.name.startswith("tokenizer"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].write_bytes(cut(shards[1].read_bytes()))
    capsys.readouterr()  # transformers' progress bar while saving
    with pytest.raises(CheckpointError) as err:
        HookedTransformer.from_pretrained(tmp_path)
    one_line(err, shards[1].name, "is not a readable safetensors file")
    for command in (["info", "--model", str(tmp_path)], ["lens", "a b", "--model", str(tmp_path)]):
        assert main(command) == 2
        out = capsys.readouterr().err.strip()
        assert shards[1].name in out and len(out.splitlines()) == 1, out


# ------------------------------------------------------------------------------------------ stacks and metrics
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_a_misshaped_stack_in_apply_ln_to_stack_names_the_shapes(family):
    model = family_model_of(family).model
    _, cache = model.run_with_cache(tokens())
    stack, _ = cache.decompose_resid(return_labels=True)  # [component, batch, pos, d_model]
    good = cache.apply_ln_to_stack(stack)
    assert good.shape == stack.shape
    d = model.cfg.d_model
    for bad in (stack[..., : d - 1], stack[:, :, :3], stack.transpose(1, 2), stack[0, 0, 0], "stack"):
        with pytest.raises(ValueError) as err:
            cache.apply_ln_to_stack(bad)
        one_line(err, "apply_ln_to_stack: residual_stack")


@pytest.mark.parametrize("sweep", [activation_patching, attribution_patching])
@pytest.mark.parametrize("metric, got", [(lambda logits: logits[:, -1, 0], "a tensor of shape (2,)"),
                                         (lambda logits: [1.0], "list"),
                                         (lambda logits: True, "bool")])
def test_a_metric_that_is_not_one_number_is_refused(sweep, metric, got):
    model = family_model_of("qwen3").model
    clean = tokens()
    corrupted = clean.flip(0)
    kwargs = {"progress": False} if sweep is activation_patching else {}
    with pytest.raises(ValueError) as err:
        sweep(model, clean, corrupted, metric, **kwargs)
    one_line(err, "the metric must return one number per run", got)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


# ------------------------------------------------------------------------------------------ dtype conversions
@pytest.mark.parametrize("family, weight", [("llama", "model.layers.1.mlp.down_proj.weight"),
                                            ("qwen3", "model.embed_tokens.weight"),
                                            ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w2.weight")])
def test_a_weight_past_float16_is_refused_after_converting(tmp_path, family, weight):
    """Checked after the conversion: 1e5 is finite in the float32 file and inf in float16 (the logits were NaN)."""
    hf = build_family_model(family).hf
    hf.save_pretrained(tmp_path)
    import safetensors.torch as st

    tensors = st.load_file(tmp_path / "model.safetensors")
    tensors[weight][0, 1] = -1e5
    st.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        HookedTransformer.from_pretrained(tmp_path, dtype="float16")
    one_line(err, "holds 100000", "past float16's largest value (65504)", "dtype='bfloat16' or 'float32'")
    model = HookedTransformer.from_pretrained(tmp_path, dtype="bfloat16")  # which holds it
    with torch.no_grad():
        assert torch.isfinite(model(tokens())).all()


def test_mxfp4_experts_dequantised_past_float16_are_refused(tmp_path):
    """An MXFP4 block whose scale takes it past 65504: exact in float32 and bfloat16, inf in float16."""
    import safetensors.torch as st
    from conftest import make_hf_family
    from test_gptoss import write_mxfp4

    hf = make_hf_family("gpt_oss", tie_word_embeddings=False, seed=8, intermediate_size=64)
    write_mxfp4(hf, tmp_path, torch.Generator().manual_seed(0))
    tensors = st.load_file(tmp_path / "model.safetensors")
    scales = tensors["model.layers.1.mlp.experts.down_proj_scales"]
    scales[0, 0, 0] = 127 + 17  # codes up to 6, times 2^17: about 7.9e5
    st.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        HookedTransformer.from_pretrained(tmp_path, dtype="float16")
    one_line(err, "blocks.1.mlp", "past float16's largest value (65504)", "dtype='bfloat16' or 'float32'")
    model = HookedTransformer.from_pretrained(tmp_path, dtype="bfloat16")
    with torch.no_grad():
        assert torch.isfinite(model(tokens() % model.cfg.d_vocab)).all()
