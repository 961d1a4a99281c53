"""circuit-tracer 0.5's TransformerLens backend on lenskit's namespace: a 1-layer GPT-2 with a transcoder this test
writes in circuit-tracer's file format, `ReplacementModel.from_pretrained_and_transcoders`, `attribute()`, a feature
intervention, and the graph's direct effects against a hand computation from the weights."""

import shutil
import sys

import pytest
import torch

pytest.importorskip("circuit_tracer", reason="runs in the ecosystem environment (scripts/ecosystem_env.sh)")

import lenskit  # noqa: E402
import lenskit.transformer_lens as tl  # noqa: E402
from circuit_tracer import ReplacementModel, attribute  # noqa: E402
from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set  # noqa: E402

D_TRANSCODER = 48
TEXT = "def mean(xs): return sum"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random 1-layer GPT-2 with the embedded model's tokenizer, and its layer-0 transcoder in circuit-tracer's
    ReLU format (a safetensors file of W_enc, W_dec [d_transcoder, d_model], b_enc, b_dec)."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from lenskit.io.hub import embedded_model_folder

    root = tmp_path_factory.mktemp("ct")
    embedded = embedded_model_folder("stdlib-gpt2")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=4096,
                                    bos_token_id=0, eos_token_id=0))
    hf.save_pretrained(root / "model")
    for f in embedded.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
            shutil.copy(f, root / "model" / f.name)
    g = torch.Generator().manual_seed(1)
    save_file({"W_enc": torch.randn(D_TRANSCODER, 32, generator=g) * 0.3, "W_dec": torch.randn(D_TRANSCODER, 32, generator=g) * 0.3,
               "b_enc": torch.randn(D_TRANSCODER, generator=g) * 0.1, "b_dec": torch.zeros(32)}, str(root / "layer0.safetensors"))
    return root


@pytest.fixture(scope="module")
def replacement(folder):
    transcoders = load_transcoder_set({0: str(folder / "layer0.safetensors")}, scan="lenskit-test",
                                      feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out",
                                      device=torch.device("cpu"), lazy_encoder=False, lazy_decoder=False)
    return ReplacementModel.from_pretrained_and_transcoders(str(folder / "model"), transcoders, device=torch.device("cpu"))


def tokens_of(model):
    return model.to_tokens(TEXT)[0]  # BOS first (id 0, which circuit-tracer's own BOS search skips)


def test_it_runs_on_the_namespace(replacement):
    assert sys.modules["transformer_lens"] is tl and isinstance(replacement, tl.HookedTransformer)
    assert [b.attn.attn_type for b in replacement.blocks] == ["global"]


def test_graph_direct_effects_by_hand(replacement):
    model = replacement
    tokens = tokens_of(model)
    graph = attribute(tokens, model, max_n_logits=3, desired_logit_prob=0.99, batch_size=64, verbose=False)
    n_pos, n_logits = len(tokens), len(graph.logit_targets)
    feats = graph.active_features  # [n, 3]: layer, pos, feature
    assert graph.adjacency_matrix.shape[0] == len(graph.selected_features) + n_pos + n_pos + n_logits  # 1 layer
    # By hand: the stream at the last position, ln_final with its scale frozen, the demeaned unembedding column.
    _, cache = tl.HookedTransformer.run_with_cache(model, tokens[None])
    x = cache["blocks.0.hook_resid_mid"][0]  # what the transcoder reads [pos, d_model]
    t = model.transcoders[0]
    acts = torch.relu(x @ t.W_enc.T + t.b_enc)  # [pos, d_transcoder]
    scale = cache["ln_final.hook_scale"][0, -1]
    W_U = model.unembed.W_U
    last = n_pos - 1
    checked = 0
    for row, target in enumerate(graph.logit_targets):
        token = target.vocab_idx
        direction = W_U[:, token] - W_U.mean(1)
        for col, sel in enumerate(graph.selected_features.tolist()):
            layer, pos, f = feats[sel].tolist()
            write = t.W_dec[f] - t.W_dec[f].mean()
            want = acts[pos, f] * (write / scale * model.ln_final.weight) @ direction if pos == last else 0.0
            got = graph.adjacency_matrix[-n_logits + row, col]
            torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype), atol=1e-4, rtol=1e-3)
            checked += pos == last
    assert checked > 0


def test_feature_intervention_changes_the_logits_as_the_decoder_says(replacement):
    model = replacement
    tokens = tokens_of(model)
    logits, acts = model.get_activations(tokens)
    pos = len(tokens) - 1
    f = int(acts[0, pos].argmax())
    new_logits, _ = model.feature_intervention(tokens, [(0, pos, f, 0.0)])
    # Switching the feature off removes its decoder row from the MLP's output at that position (1 layer: nothing
    # later reads it), then ln_final and the unembedding: by hand from the clean run's stream.
    _, cache = tl.HookedTransformer.run_with_cache(model, tokens[None])
    resid = cache["blocks.0.hook_resid_post"][0, pos] - acts[0, pos, f] * model.transcoders[0].W_dec[f]
    want = model.unembed(model.ln_final(resid))
    torch.testing.assert_close(new_logits[0, pos], want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(new_logits[0, pos], logits[0, pos], atol=1e-3)
