"""TransformerLens's calls on lenskit, each checked against a direct computation, on GPT-2 (learned
positions, LayerNorm, biases) and Llama (rotary, RMSNorm, grouped-query attention, SwiGLU, no biases)
and Qwen 2 (q/k/v biases under GQA) where biases matter."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_family
from fixtures import close

import lenskit
from lenskit import HookedTransformer, get_act_name

ALL = lambda name: True  # noqa: E731 - every hook, hook_result included


def final_norm_of(hf) -> torch.nn.Module:
    return hf.transformer.ln_f if hasattr(hf, "transformer") else hf.model.norm


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def setup(request):
    hf = make_hf_family(request.param)
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=ALL)
    return request.param, hf, model, tokens, logits, cache


# ------------------------------------------------------------------------ cache
def test_accumulated_resid_apply_ln_is_the_final_norm_per_stream(setup):
    _, hf, model, _, logits, cache = setup
    n = model.cfg.n_layers
    stack, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == [f"{l}_pre" for l in range(n)] + ["final_post"]
    hf_norm = final_norm_of(hf)
    with torch.no_grad():
        for l in range(n + 1):  # transformers' own final norm, its statistics from this stream alone
            close(stack[l], hf_norm(cache.stream(l)))
        close(model.unembed(stack[n]), logits)
        # The bug TransformerLens once shipped, the final stream's cached scale used for every stream, differs.
        bias = getattr(model.ln_final, "bias", 0.0)
        stale = cache.apply_ln_to_stack(cache.accumulated_resid()) + bias
        close(stale[n], stack[n], atol=1e-4)
        assert not torch.allclose(stale[0], stack[0], atol=1e-2)


def test_accumulated_resid_layer_pos_slice_and_mid(setup):
    _, _, model, _, _, cache = setup
    n = model.cfg.n_layers
    first, labels = cache.accumulated_resid(layer=1, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre"]
    assert torch.equal(first[1], cache["resid_mid", 0])
    _, labels = cache.accumulated_resid(layer=1, mlp_input=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "1_mid"]
    last = cache.accumulated_resid(pos_slice=-1)  # an int drops the position axis
    assert last.shape == (n + 1, 2, model.cfg.d_model)
    assert torch.equal(last, cache.accumulated_resid()[:, :, -1])
    assert torch.equal(cache.accumulated_resid(pos_slice=(2, 5)), cache.accumulated_resid()[:, :, 2:5])
    assert torch.equal(cache.accumulated_resid(pos_slice=[0, 3]), cache.accumulated_resid()[:, :, [0, 3]])
    assert torch.equal(cache.accumulated_resid(layer=-1), cache.accumulated_resid(layer=n))
    with pytest.raises(ValueError, match=f"layer must be 0..{n} .*got -2"):
        cache.accumulated_resid(layer=-2)


def test_decompose_resid_sums_to_the_stream(setup):
    family, _, model, _, _, cache = setup
    n = model.cfg.n_layers
    for layer in range(n + 1):
        for mlp_input in ([False, True] if layer < n else [False]):
            stack, labels = cache.decompose_resid(layer, mlp_input=mlp_input, return_labels=True)
            target = cache["resid_mid", layer] if mlp_input else cache.stream(layer)
            close(stack.sum(0), target)
            assert len(labels) == stack.shape[0]
    _, labels = cache.decompose_resid(return_labels=True)
    embeds = ["embed", "pos_embed"] if family == "gpt2" else ["embed"]  # rotary families add no position vector
    assert labels == embeds + [f"{l}_{w}_out" for l in range(n) for w in ("attn", "mlp")]
    _, attn = cache.decompose_resid(mode="attn", incl_embeds=False, return_labels=True)
    assert attn == [f"{l}_attn_out" for l in range(n)]
    assert cache.decompose_resid(0, incl_embeds=False).shape == (0, 2, 9, model.cfg.d_model)
    with pytest.raises(ValueError, match="mode must be"):
        cache.decompose_resid(mode="heads")


def test_apply_ln_to_stack_sums_to_the_norm_output(setup):
    """Pieces through a norm with the whole stream's cached scale add up to that norm's output less its bias."""
    _, _, model, _, _, cache = setup
    n = model.cfg.n_layers
    for layer in range(n + 1):
        for mlp_input in ([False, True] if layer < n else [False]):
            norm = model.ln_final if layer == n else getattr(model.blocks[layer], "ln2" if mlp_input else "ln1")
            bias = getattr(norm, "bias", torch.zeros(()))
            stack = cache.decompose_resid(layer, mlp_input=mlp_input, apply_ln=True)
            close(stack.sum(0) + bias, cache[norm.hook_normalized.name], atol=1e-4)
    # The direct formula on one piece: centre (LayerNorm only), divide by the cached scale, times the gain.
    piece = cache["attn_out", 0][None]
    x = piece - piece.mean(-1, keepdim=True) if hasattr(model.ln_final, "bias") else piece
    expected = x / cache["ln_final.hook_scale"] * model.ln_final.weight
    close(cache.apply_ln_to_stack(piece), expected)
    close(cache.apply_ln_to_stack(piece, batch_slice=(1, 2)), expected[:, 1:])  # sliced here, as in TransformerLens
    close(cache.apply_ln_to_stack(piece[:, :, -1], pos_slice=-1), expected[:, :, -1])


def test_stack_head_results(setup):
    _, _, model, _, _, cache = setup
    n, h = model.cfg.n_layers, model.cfg.n_heads
    stack, labels = cache.stack_head_results(return_labels=True)
    assert stack.shape == (n * h, 2, 9, model.cfg.d_model)
    assert labels[:h + 1] == [f"L0H{i}" for i in range(h)] + ["L1H0"]
    W_O = model.W_O
    for l in range(n):
        for head in range(h):  # head's write = its z through its slice of W_O
            close(stack[l * h + head], cache["z", l][:, :, head] @ W_O[l, head])
        close(stack[l * h:(l + 1) * h].sum(0) + model.b_O[l], cache["attn_out", l])
    with_rest, labels = cache.stack_head_results(layer=1, incl_remainder=True, return_labels=True)
    assert labels[-1] == "remainder" and with_rest.shape[0] == h + 1
    close(with_rest.sum(0), cache.stream(1))
    normed = cache.stack_head_results(layer=1, incl_remainder=True, apply_ln=True)
    close(normed.sum(0) + getattr(model.blocks[1].ln1, "bias", 0.0), cache["normalized", 1, "ln1"], atol=1e-4)
    assert cache.stack_head_results(layer=0).shape == (0, 2, 9, model.cfg.d_model)
    assert cache.stack_head_results(pos_slice=0).shape == (n * h, 2, model.cfg.d_model)


def test_stack_head_results_computes_hook_result_from_z_as_transformerlens_does(model):
    tokens = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(4))
    _, recorded = model.run_with_cache(tokens, names_filter=ALL)
    _, cache = model.run_with_cache(tokens)
    assert "blocks.0.attn.hook_result" not in cache
    close(cache.stack_head_results(), recorded.stack_head_results())
    _, no_z = model.run_with_cache(tokens, names_filter=lambda name: not name.endswith(("hook_z", "hook_result")))
    with pytest.raises(KeyError, match="needs 'blocks.0.attn.hook_z'"):
        no_z.stack_head_results()


def test_remove_batch_dim(model):
    tokens = torch.randint(0, 101, (1, 6), generator=torch.Generator().manual_seed(3))
    _, cache = model.run_with_cache(tokens)
    batched = {k: v.clone() for k, v in cache.items()}
    assert cache.remove_batch_dim() is cache and not cache.has_batch_dim
    assert all(torch.equal(cache[k], v[0]) for k, v in batched.items())
    assert cache.accumulated_resid().shape == (model.cfg.n_layers + 1, 6, model.cfg.d_model)
    close(cache.accumulated_resid(apply_ln=True)[-1], model.ln_final(batched["blocks.2.hook_resid_post"][0]))
    with pytest.warns(UserWarning, match="already removed"):
        assert cache.remove_batch_dim() is cache  # a second call drops nothing more
    assert all(torch.equal(cache[k], v[0]) for k, v in batched.items())
    _, two = model.run_with_cache(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 2"):
        two.remove_batch_dim()


def test_a_cache_without_a_model_says_so():
    cache = lenskit.ActivationCache({"blocks.0.hook_resid_pre": torch.zeros(1, 2, 3),
                                     "blocks.0.hook_resid_post": torch.ones(1, 2, 3)}, n_layers=1)
    assert cache.accumulated_resid().shape == (2, 1, 2, 3)
    with pytest.raises(ValueError, match="built without a model"):
        cache.accumulated_resid(apply_ln=True)


# ------------------------------------------------------------- names and hooks
def test_get_act_name_matches_transformerlens_spellings(model):
    expected = {
        ("resid_pre", 3, None): "blocks.3.hook_resid_pre", ("attn_out", 0, None): "blocks.0.hook_attn_out",
        ("pattern", 2, None): "blocks.2.attn.hook_pattern", ("attn", 2, None): "blocks.2.attn.hook_pattern",
        ("q", 1, None): "blocks.1.attn.hook_q", ("z", 1, "a"): "blocks.1.attn.hook_z",
        ("result", 0, None): "blocks.0.attn.hook_result", ("pre", 2, None): "blocks.2.mlp.hook_pre",
        ("post", 2, None): "blocks.2.mlp.hook_post", ("mlp_out", 1, None): "blocks.1.hook_mlp_out",
        ("scale", 4, "ln1"): "blocks.4.ln1.hook_scale", ("normalized", 27, "ln2"): "blocks.27.ln2.hook_normalized",
        ("scale", None, None): "ln_final.hook_scale", ("normalized", None, None): "ln_final.hook_normalized",
        ("embed", None, None): "hook_embed", ("pos_embed", None, None): "hook_pos_embed",
        ("k6", None, None): "blocks.6.attn.hook_k", ("scale4ln1", None, None): "blocks.4.ln1.hook_scale",
        ("pre5", None, None): "blocks.5.mlp.hook_pre", ("resid_post11", None, None): "blocks.11.hook_resid_post",
        ("blocks.0.hook_resid_pre", None, None): "blocks.0.hook_resid_pre",
    }
    for (name, layer, layer_type), full in expected.items():
        assert get_act_name(name, layer, layer_type) == full, (name, layer, layer_type)
    # Every short name names a real hook point of the model (layer 0 of a 3-block GPT-2).
    for short in ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "z", "pattern",
                  "attn_scores", "result", "pre", "post"]:
        assert get_act_name(short, 0) in model.hook_dict
    for short, layer_type in [("scale", "ln1"), ("normalized", "ln2")]:
        assert get_act_name(short, 0, layer_type) in model.hook_dict
    with pytest.raises(KeyError, match="unknown activation name 'resid'"):
        get_act_name("resid", 0)
    with pytest.raises(ValueError, match="pass a layer"):
        get_act_name("q")
    with pytest.raises(ValueError, match="layer_type 'ln1' or 'ln2'"):
        get_act_name("scale", 0)


def test_cache_reads_transformerlens_keys(setup):
    _, _, model, _, _, cache = setup
    assert cache["embed"] is cache["hook_embed"]
    assert cache["q0"] is cache["blocks.0.attn.hook_q"]
    assert cache["scale", 1, "ln2"] is cache["blocks.1.ln2.hook_scale"]
    assert cache["result", -1, "attn"] is cache[f"blocks.{model.cfg.n_layers - 1}.attn.hook_result"]


def test_hook_layer(model):
    seen = {}
    for name, hp in model.hook_dict.items():
        if name.startswith("blocks."):
            seen[name] = hp.layer()
            assert seen[name] == int(name.split(".")[1])
        else:
            with pytest.raises(ValueError, match="not inside a block"):
                hp.layer()
    assert seen["blocks.2.attn.hook_pattern"] == 2 and seen["blocks.0.ln1.hook_scale"] == 0
    captured = []
    model.run_with_hooks(torch.zeros(1, 3, dtype=torch.long),
                         fwd_hooks=[(lambda n: n.endswith("hook_z"), lambda x, hook: captured.append(hook.layer()))])
    assert captured == [0, 1, 2]


# ------------------------------------------------------------------ the model
def test_weight_views_reproduce_the_forward_pass(setup):
    family, _, model, tokens, logits, cache = setup
    c = model.cfg
    group = c.n_heads // c.n_kv_heads
    assert model.W_Q.shape == model.W_K.shape == model.W_V.shape == (c.n_layers, c.n_heads, c.d_model, c.d_head)
    assert model.W_O.shape == (c.n_layers, c.n_heads, c.d_head, c.d_model)
    close(model.W_E[tokens], cache["embed"])
    if family == "gpt2":
        close(model.W_pos[:tokens.shape[1]], cache["pos_embed"][0])
    else:
        assert not hasattr(model, "W_pos")
    for l in range(c.n_layers):
        x = cache["normalized", l, "ln1"]  # [batch, pos, d_model]
        close(torch.einsum("bpm,hmd->bphd", x, model.W_Q[l]) + model.b_Q[l], cache["q", l])
        for w, b, short in [(model.W_K, model.b_K, "k"), (model.W_V, model.b_V, "v")]:
            per_head = cache[short, l].repeat_interleave(group, dim=2)  # query head h reads kv head h // group
            close(torch.einsum("bpm,hmd->bphd", x, w[l]) + b[l], per_head)
            close(w[l, ::group], w[l, ::group].clone())  # the kv heads themselves
            assert torch.equal(w[l].unflatten(0, (c.n_kv_heads, group)), w[l, ::group, None].expand(-1, group, -1, -1))
        close(torch.einsum("bphd,hdm->bpm", cache["z", l], model.W_O[l]) + model.b_O[l], cache["attn_out", l])
        m = cache["normalized", l, "ln2"]
        if model.W_gate is None:
            close(m @ model.W_in[l] + model.b_in[l], cache["pre", l])
        else:
            close(m @ model.W_gate[l], cache["pre", l])
            close(m @ model.W_in[l], cache["blocks.%d.mlp.hook_pre_linear" % l])
        close(cache["post", l] @ model.W_out[l] + model.b_out[l], cache["mlp_out", l])
    close(cache["ln_final.hook_normalized"] @ model.W_U + model.b_U, logits, atol=1e-4)


def test_weight_views_match_transformers_parameters(setup):
    family, hf, model, *_ = setup
    c = model.cfg
    if family == "gpt2":
        attn = hf.transformer.h[1].attn.c_attn.weight  # Conv1D: [d_model, 3 * d_model], x @ W
        assert torch.equal(model.W_Q[1], attn[:, :c.d_model].view(c.d_model, c.n_heads, c.d_head).transpose(0, 1))
        assert torch.equal(model.W_in[1], hf.transformer.h[1].mlp.c_fc.weight)
    else:
        layer = hf.model.layers[1]
        assert torch.equal(model.W_K[1, ::c.n_heads // c.n_kv_heads],
                           layer.self_attn.k_proj.weight.view(c.n_kv_heads, c.d_head, c.d_model).transpose(1, 2))
        assert torch.equal(model.W_gate[1], layer.mlp.gate_proj.weight.T)
        assert torch.equal(model.W_out[1], layer.mlp.down_proj.weight.T)
        if family == "llama":  # no biases: zeros, as TransformerLens shows them
            assert not model.b_Q.any() and not model.b_in.any()
        else:
            assert torch.equal(model.b_Q[1].flatten(), layer.self_attn.q_proj.bias)
    assert torch.equal(model.W_U, hf.lm_head.weight.T)


def test_forward_return_type(setup):
    _, hf, model, tokens, logits, _ = setup
    with torch.no_grad():
        loss = model(tokens, return_type="loss")
        manual = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        close(loss, manual)
        close(loss, hf(tokens, labels=tokens).loss)  # transformers' own shifted mean cross-entropy
        both = model(tokens, return_type="both")
        close(both[0], logits) and close(both[1], loss)
        assert model(tokens, return_type=None) is None
        close(model(tokens, "logits"), logits)
    with pytest.raises(ValueError, match="return_type must be"):
        model(tokens, return_type="probs")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(tokens[:, :1], return_type="loss")


def test_add_hook_is_global_until_reset(model):
    tokens = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(4))
    zero = lambda x, hook: torch.zeros_like(x)  # noqa: E731
    clean = model(tokens)
    expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_attn_out", zero)])
    try:
        model.add_hook("blocks.1.hook_attn_out", zero)
        close(model(tokens), expected)
        other = []
        thread = threading.Thread(target=lambda: other.append(model(tokens)))
        thread.start(), thread.join()
        close(other[0], expected)  # global: another thread sees it too
    finally:
        model.reset_hooks()
    close(model(tokens), clean)
    model.add_hook(lambda n: n.endswith("hook_mlp_out"), zero)
    model.reset_hooks()
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


def test_generate_sampling(setup):
    _, _, model, tokens, _, _ = setup
    prompt = tokens[:, :4]
    greedy = prompt
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, model(greedy)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, 6), greedy)
    assert torch.equal(model.generate(prompt, 6, do_sample=True, temperature=0), greedy)
    assert torch.equal(model.generate(prompt, 6, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0)), greedy)
    assert torch.equal(model.generate(prompt, 6, do_sample=True, top_p=1e-6, generator=torch.Generator().manual_seed(0)), greedy)

    def sample(seed):
        return model.generate(prompt, 8, do_sample=True, top_k=5, temperature=2.0, generator=torch.Generator().manual_seed(seed))

    runs = [sample(seed) for seed in range(4)]
    assert torch.equal(runs[0], sample(0))  # seeded: reproducible
    assert any(not torch.equal(runs[0], r) for r in runs[1:])  # and actually random
    with torch.no_grad():
        for out in runs:  # every sampled token is one of the 5 most likely at its step
            for t in range(4, out.shape[1]):
                allowed = model(out[:, :t])[:, -1].topk(5).indices  # [batch, 5]
                assert (allowed == out[:, t:t + 1]).any(-1).all()
    for bad, match in [(dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p")]:
        with pytest.raises(ValueError, match=match):
            model.generate(prompt, 2, do_sample=True, **bad)


# --------------------------------------------------------------------- tokens
def test_prepend_bos_default_follows_the_tokenizer():
    """Pinned: lenskit's to_tokens adds BOS only where the checkpoint's tokenizer does (docs/howto/transformer_lens.md,
    "BOS on text input"): not for GPT-2-style tokenizers (TransformerLens would), yes for Llama 3-style ones."""
    from test_hub import llama3_style_tokenizer
    from tiny_tokenizer import make_model_with_tokenizer

    gpt2 = make_model_with_tokenizer()
    bos = gpt2.tokenizer.bos_token_id
    assert gpt2.to_tokens("def f")[0, 0] != bos
    assert gpt2.to_tokens("def f", prepend_bos=True)[0].tolist() == [bos, *gpt2.to_tokens("def f")[0].tolist()]
    llama = HookedTransformer.from_hf(make_hf_family("llama"), tokenizer=llama3_style_tokenizer())
    bos = llama.tokenizer.bos_token_id
    tokens = llama.to_tokens("hello world")
    assert tokens[0, 0] == bos and tokens[0, 1] != bos
    assert llama.to_tokens("hello world", prepend_bos=False).tolist() == [tokens[0, 1:].tolist()]



def test_trajectories_tokenize_as_to_tokens_does():
    """Lenses tokenize through the same helper as `to_tokens`, so a Llama 3-style BOS is there too."""
    from test_hub import llama3_style_tokenizer

    from lenses import LogitLens, Trajectory

    llama = HookedTransformer.from_hf(make_hf_family("llama"), tokenizer=llama3_style_tokenizer())
    traj = Trajectory.from_prompt(LogitLens(llama), ["hello world", "hello"])
    assert traj.tokens.tolist() == llama.to_tokens(["hello world", "hello"]).tolist()
    assert traj.tokens[0, 0] == llama.tokenizer.bos_token_id


def test_to_single_token():
    from tiny_tokenizer import make_model_with_tokenizer

    model = make_model_with_tokenizer()
    token = model.to_tokens("def")[0]
    assert token.numel() == 1 and model.to_single_token("def") == int(token[0])
    assert model.to_str_tokens(torch.tensor([model.to_single_token("def")])) == ["def"]
    with pytest.raises(ValueError, match="exactly one token"):
        model.to_single_token("def add(a, b):")
