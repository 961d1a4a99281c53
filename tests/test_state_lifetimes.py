"""No state outlives its call (issue 40, item 5): rotary tables made under inference_mode serve a later autograd pass;
a KVCache stays bound to the model instance it first ran with; `positions=` are absolute positions, also under the KV
cache; a tensor spelled twice in a checkpoint and an impossible device are refused in one line."""

from __future__ import annotations

import gc

import pytest
import safetensors.torch
import torch
from families import FAMILY_BUILDERS, build_family_model, family_model_of
from golden import rounding

from lenses import JacobianLens
from lenskit import HookedTransformer
from lenskit.intervene.attribution import attribution_patching
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.intervene.interventions import Head, Mlp, ablation_hooks
from lenskit.intervene.patching import logit_diff
from lenskit.kv_cache import KVCache

# but GPT-2's learned positions, Nemotron-H's and Granite 4's none (its tiny model's attention is "nope")
ROTARY = [f for f in FAMILY_BUILDERS if f not in ("gpt2", "nemotron_h", "granitemoehybrid")]


def tokens(pos: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 300, (2, pos), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ inference mode
@pytest.mark.parametrize("family", ROTARY)
def test_an_inference_mode_forward_leaves_nothing_that_autograd_cannot_use(family):
    """The first forward builds the rotary tables; under inference_mode they were inference tensors, which every
    later backward refused ("Inference tensors cannot be saved for backward")."""
    model = build_family_model(family).model  # fresh: its tables are built by the inference-mode forward below
    assert model.cfg.positional == "rotary", family
    clean = tokens()
    with torch.inference_mode():
        model(clean)
    corrupted = clean.clone()
    corrupted[:, 3] = (clean[:, 3] + 7) % 300
    df = attribution_patching(model, clean, corrupted, logit_diff(3, 5), sites=["resid_pre"])
    assert df["attribution"].abs().sum() > 0
    lens = JacobianLens.fit(model, clean, skip_first_positions=2, streams=[1], progress=False)
    assert torch.isfinite(lens.matrix(1)).all() and lens.matrix(1).abs().sum() > 0
    grads = []
    with model.hooks(bwd_hooks=[("blocks.0.hook_resid_post", lambda g, hook: grads.append(g))]):
        model(clean, return_type="loss").backward()
    assert len(grads) == 1 and grads[0].abs().sum() > 0


def test_gradients_inside_inference_mode_are_refused_in_one_line():
    model = family_model_of("llama").model
    clean = tokens()
    corrupted = clean.flip(0)
    calls = [
        lambda: attribution_patching(model, clean, corrupted, logit_diff(3, 5)),
        lambda: JacobianLens.fit(model, clean, skip_first_positions=2, streams=[1], progress=False),
        lambda: model.hooks(bwd_hooks=[("blocks.0.hook_resid_post", lambda g, hook: None)]).__enter__(),
        lambda: model.run_with_cache(clean, incl_bwd=True, return_type="loss"),
    ]
    with torch.inference_mode():
        for call in calls:
            with pytest.raises(RuntimeError, match="needs gradients, which torch.inference_mode") as err:
                call()
            assert "\n" not in str(err.value)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


# ------------------------------------------------------------------------------------------ the KV cache's model
def test_a_cache_is_refused_by_an_equal_config_model_also_after_its_own_is_collected():
    model = build_family_model("llama").model
    twin = HookedTransformer(model.cfg)  # an equal config and other weights: the cached keys are not its keys
    cache = KVCache(model.cfg, 2)
    with torch.no_grad():
        model(tokens(4), past_kv_cache=cache)
        with pytest.raises(ValueError, match="made for another model"):
            twin(tokens(1), past_kv_cache=cache)
        del model
        gc.collect()
        with pytest.raises(ValueError, match="model was garbage-collected") as err:
            twin(tokens(1), past_kv_cache=cache)
    assert "\n" not in str(err.value) and cache.n_pos == 4


# ------------------------------------------------------------------------------------------ absolute positions
def stepped(model, toks: torch.Tensor, hooks, prompt: int = 4) -> torch.Tensor:
    """Logits [batch, pos, d_vocab] of toks through a KV cache (the prompt, then one token at a time) under hooks."""
    cache = KVCache(model.cfg, toks.shape[0])
    with torch.no_grad(), model.hooks(hooks):
        out = [model(toks[:, :prompt], past_kv_cache=cache)]
        out += [model(toks[:, p:p + 1], past_kv_cache=cache) for p in range(prompt, toks.shape[1])]
    return torch.cat(out, dim=1)


POSITIONAL = [
    ("llama", lambda m: ablation_hooks(m, [Mlp(1)], positions=[2])),              # a position inside the prompt
    ("qwen3", lambda m: ablation_hooks(m, [Mlp(0)], positions=0)),               # each cached step's first, before
    ("mistral", lambda m: ablation_hooks(m, [Head(0, 1)], positions=[5, 7])),     # positions only later steps reach
    ("mixtral", lambda m: expert_ablation_hooks(m, Expert(1, [0, 1]), positions=[1, 6])),
    ("olmoe", lambda m: expert_ablation_hooks(m, Expert(0, [0, 1]), "reroute", positions=[6])),
    ("gemma4_text", lambda m: ablation_hooks(m, [Mlp(2)], positions=[0, 6])),
]


@pytest.mark.parametrize("family, make", POSITIONAL, ids=[f for f, _ in POSITIONAL])
def test_positions_are_absolute_also_under_the_kv_cache(family, make):
    """Cached steps give the full forward's logits under a positional edit: before, each cached step called its one
    token position 0, so positions=[0] hit every generated token and a later position none."""
    model = family_model_of(family).model
    toks = tokens(9)
    hooks = make(model)
    with torch.no_grad():
        plain = model(toks)
        with model.hooks(hooks):
            want = model(toks)
    assert (want - plain).abs().max() > 1e-3  # the edit changes something, so agreeing below means something
    assert (stepped(model, toks, hooks) - want).abs().max() <= rounding(model, toks)


def test_generation_with_and_without_the_cache_agree_under_a_positional_edit():
    model = family_model_of("mixtral").model
    prompt = tokens(4)[:1]
    with model.hooks(expert_ablation_hooks(model, Expert(0, [0, 1, 2]), positions=[0, 3])):  # prompt positions
        cached = model.generate(prompt, max_new_tokens=5, use_past_kv_cache=True, stop_at_eos=False)
        uncached = model.generate(prompt, max_new_tokens=5, use_past_kv_cache=False, stop_at_eos=False)
    assert torch.equal(cached, uncached)  # the logits' agreement, edit by edit, is the test above


def test_a_negative_position_under_the_kv_cache_is_refused():
    model = family_model_of("llama").model
    cache = KVCache(model.cfg, 2)
    with torch.no_grad(), model.hooks(ablation_hooks(model, [Mlp(0)], positions=[-1])):
        with pytest.raises(IndexError, match="under a KV cache is another token at each step") as err:
            model(tokens(4), past_kv_cache=cache)
    assert "\n" not in str(err.value) and cache.n_pos == 0


# ------------------------------------------------------------------------------------------ files and devices
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_experts_in_both_spellings_are_refused_by_name(family, tmp_path):
    """A checkpoint with the hub's per-expert tensors and transformers 5's fused ones: which copy is meant is not
    ours to guess (the fused one used to win silently)."""
    hf = build_family_model(family).hf
    hf.save_pretrained(tmp_path)  # per-expert names
    per_expert = safetensors.torch.load_file(tmp_path / "model.safetensors")
    fused = {k: v.clone() + 1 for k, v in hf.state_dict().items() if ".experts." in k and k not in per_expert}
    assert fused  # transformers 5 holds the experts fused in memory
    safetensors.torch.save_file({**per_expert, **fused}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds expert \d+ of .* twice: as .* and inside the fused") as err:
        HookedTransformer.from_pretrained(tmp_path)
    assert "\n" not in str(err.value)
    safetensors.torch.save_file(per_expert, tmp_path / "model.safetensors", metadata={"format": "pt"})
    HookedTransformer.from_pretrained(tmp_path)  # one spelling loads


@pytest.mark.parametrize("kwargs, words", [
    ({"cache_device": "meta"}, "cache_device='meta': the meta device holds shapes and no values"),
    ({"device": "meta"}, "device='meta': the meta device holds shapes and no values"),
    ({"cache_device": "tpu9"}, "cache_device='tpu9' is not a device torch knows"),
    pytest.param({"cache_device": "cuda"}, "cache_device='cuda', but this torch",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_an_impossible_cache_device_is_refused_in_one_line(kwargs, words):
    model = family_model_of("gpt2").model
    with pytest.raises(ValueError) as err:
        model.run_with_cache(tokens(3), **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


@pytest.mark.parametrize("kwargs, words", [
    ({"device_map": {"": "meta"}}, "device_map='meta': the meta device"),
    ({"device": "meta"}, "device='meta': the meta device"),
    ({"device": "nowhere"}, "device='nowhere' is not a device torch knows"),
    pytest.param({"device": "cuda"}, "device='cuda', but this torch",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_an_impossible_weight_device_is_refused_in_one_line(kwargs, words, tmp_path):
    build_family_model("qwen3").hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        HookedTransformer.from_pretrained(tmp_path, **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
