"""The Mamba-2 mixer piece (lenskit.pieces.mamba2) against transformers' own mixers (their torch path: neither
mamba-ssm nor causal-conv1d is installed for the tests), against the plain recurrence, and its state cache."""

from __future__ import annotations

import pytest
import torch
import transformers
from golden import max_diff
from transformers.models.falcon_h1 import modeling_falcon_h1
from transformers.models.granitemoehybrid import modeling_granitemoehybrid
from transformers.models.nemotron_h import modeling_nemotron_h

from lenskit import ModelConfig
from lenskit.kv_cache import MambaState
from lenskit.pieces.forward_state import ForwardState
from lenskit.pieces.mamba2 import Mamba2Mixer, chunked_scan, recurrent_scan

# Eight heads of 6 in two groups of B and C 5 wide, a kernel of 4, chunks of 16 (prompts span several).
HEADS, D_HEAD, D_STATE, GROUPS, CHUNK = 8, 6, 5, 2, 16
NAMES = {"in_proj.weight": "in_proj.weight", "conv_weight": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
         "D": "D", "out_proj.weight": "out_proj.weight"}


def _cfg(**mamba) -> ModelConfig:
    fields = {**dict(mamba_n_heads=HEADS, mamba_d_head=D_HEAD, mamba_d_state=D_STATE, mamba_n_groups=GROUPS,
                     mamba_chunk_size=CHUNK), **mamba}
    return ModelConfig(n_layers=1, d_model=32, n_heads=4, d_vocab=11, n_ctx=512, norm_eps=1e-5, layer_types=("mamba",),
                       **fields)


def _randomised(hf: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.rand_like(hf.A_log) * 3 - 2)  # decays from fast to slow
        hf.dt_bias.copy_(torch.randn_like(hf.dt_bias) - 1)


def _ours_from(hf: torch.nn.Module, cfg: ModelConfig) -> Mamba2Mixer:
    ours = Mamba2Mixer(cfg)
    state = hf.state_dict()
    optional = {"conv_bias": "conv1d.bias", "in_proj.bias": "in_proj.bias", "out_proj.bias": "out_proj.bias",
                "norm.weight": "norm.weight"}
    names = {**NAMES, **{k: v for k, v in optional.items() if v in state}}
    ours.load_state_dict({k: state[v] for k, v in names.items()})
    return ours


def _nemotron(seed: int = 0, **extra):
    torch.manual_seed(seed)
    config = transformers.NemotronHConfig(hidden_size=32, mamba_num_heads=HEADS, mamba_head_dim=D_HEAD,
                                          ssm_state_size=D_STATE, n_groups=GROUPS, conv_kernel=4, chunk_size=CHUNK,
                                          layers_block_type=["linear_attention"], layer_norm_epsilon=1e-5, **extra)
    hf = modeling_nemotron_h.NemotronHMamba2Mixer(config, layer_idx=0).eval()
    _randomised(hf)
    limit = tuple(config.time_step_limit)
    cfg = _cfg(mamba_conv_bias=config.use_conv_bias, mamba_in_bias=config.use_bias, mamba_out_bias=config.use_bias,
               mamba_dt_min=float(limit[0]), mamba_dt_max=float(limit[1]))
    return hf, _ours_from(hf, cfg)


@pytest.mark.parametrize("pos", [50, 32, 5])  # several chunks and a part one, whole chunks, shorter than one
def test_mixer_matches_nemotron_h_torch_path(pos):
    hf, ours = _nemotron()
    x = torch.randn(3, pos, 32, generator=torch.Generator().manual_seed(pos))
    with torch.no_grad():
        want = hf(x)
        assert max_diff(ours(x), want) <= 1e-5
        ours.scan = recurrent_scan
        assert max_diff(ours(x), want) <= 1e-5


def test_mixer_with_biases_and_a_step_limit_matches_nemotron_h():
    """Biased projections, and step sizes clamped to a range that binds (transformers' chunked path clamps them)."""
    hf, ours = _nemotron(1, use_bias=True, use_conv_bias=True, time_step_limit=(0.05, 0.4))
    assert ours.in_proj.bias is not None and ours.out_proj.bias is not None and ours.dt_range == (0.05, 0.4)
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(ours(x), hf(x)) <= 1e-5


def test_mixer_matches_granite_4_torch_path():
    torch.manual_seed(2)
    config = transformers.GraniteMoeHybridConfig(hidden_size=24, mamba_n_heads=HEADS, mamba_d_head=D_HEAD,
                                                 mamba_d_state=D_STATE, mamba_n_groups=GROUPS, mamba_d_conv=4,
                                                 mamba_expand=2, mamba_chunk_size=CHUNK, num_hidden_layers=1,
                                                 layer_types=["mamba"], rms_norm_eps=1e-6)
    hf = modeling_granitemoehybrid.GraniteMoeHybridMambaLayer(config, layer_idx=0).eval()
    _randomised(hf)
    cfg = _cfg(mamba_conv_bias=True).replace(d_model=24, norm_eps=1e-6)
    ours = _ours_from(hf, cfg)
    x = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert max_diff(ours(x), hf(x)) <= 1e-5


@pytest.mark.parametrize("norm", ["norm_then_gate", "gate_then_norm", "gate_only"])
def test_mixer_matches_falcon_h1_torch_path_with_its_multipliers(norm):
    """Falcon-H1's three forms of the gate, its input and per-part multipliers and its biased out_proj."""
    torch.manual_seed(4)
    config = transformers.FalconH1Config(
        hidden_size=24, mamba_d_ssm=HEADS * D_HEAD, mamba_n_heads=HEADS, mamba_d_head=D_HEAD, mamba_d_state=D_STATE,
        mamba_n_groups=GROUPS, mamba_d_conv=4, mamba_chunk_size=CHUNK, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_rms_norm=norm != "gate_only", mamba_norm_before_gate=norm == "norm_then_gate",
        projectors_bias=True, ssm_in_multiplier=0.7, ssm_multipliers=[1.5, 0.5, 2.0, 0.25, 1.25], rms_norm_eps=1e-5)
    hf = modeling_falcon_h1.FalconH1Mixer(config, layer_idx=0).eval()
    hf.register_buffer("mup_vector", modeling_falcon_h1.compute_mup_vector(config), persistent=False)
    _randomised(hf)
    cfg = _cfg(mamba_norm=norm, mamba_out_bias=True, mamba_in_multiplier=0.7,
               mamba_multipliers=(1.5, 0.5, 2.0, 0.25, 1.25)).replace(d_model=24)
    ours = _ours_from(hf, cfg)
    x = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert max_diff(ours(x), hf(x)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_scan_equals_the_recurrence_and_its_state(dtype):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 70, HEADS, D_HEAD, generator=gen, dtype=dtype)
    dt = torch.rand(2, 70, HEADS, generator=gen, dtype=dtype) * 0.5
    A = -torch.rand(HEADS, generator=gen, dtype=dtype) * 4
    B, C = (torch.randn(2, 70, GROUPS, D_STATE, generator=gen, dtype=dtype) for _ in range(2))
    start = torch.randn(2, HEADS, D_HEAD, D_STATE, generator=gen, dtype=dtype)
    for state in (None, start):
        ref_out, ref_state = recurrent_scan(x, dt, A, B, C, state)
        for chunk in (1, 7, 16, 64, 256):
            out, final = chunked_scan(x, dt, A, B, C, state, chunk)
            assert out.shape == (2, 70, HEADS, D_HEAD) and final.shape == (2, HEADS, D_HEAD, D_STATE)
            assert max_diff(out, ref_out) <= 1e-5 and max_diff(final, ref_state) <= 1e-5
    # transformers' own chunked torch function computes the same outputs and final state
    their_out, their_state = modeling_nemotron_h.mamba2_chunk_scan(x, dt, A, B, C, 16, initial_states=start,
                                                                  return_final_states=True)
    ref_out, ref_state = recurrent_scan(x, dt, A, B, C, start)
    assert max_diff(their_out, ref_out) <= 1e-5 and max_diff(their_state, ref_state) <= 1e-5


def test_the_recurrence_is_the_definition_at_one_position():
    """One step from a state, written out by hand: S' = exp(dt A) S + dt x B^T, y = S' C."""
    gen = torch.Generator().manual_seed(7)
    x, dt = torch.randn(1, 1, 2, 3, generator=gen), torch.rand(1, 1, 2, generator=gen)
    A, B, C = -torch.rand(2, generator=gen), torch.randn(1, 1, 1, 4, generator=gen), torch.randn(1, 1, 1, 4, generator=gen)
    S = torch.randn(1, 2, 3, 4, generator=gen)
    out, new = recurrent_scan(x, dt, A, B, C, S)
    for h in range(2):
        want = torch.exp(dt[0, 0, h] * A[h]) * S[0, h] + dt[0, 0, h] * torch.outer(x[0, 0, h], B[0, 0, 0])
        assert max_diff(new[0, h], want) <= 1e-6 and max_diff(out[0, 0, h], want @ C[0, 0, 0]) <= 1e-6


def test_state_cache_continues_the_prompt():
    """A prompt in pieces (the first through the chunked scan, then one position, then several, each from the
    carried convolution inputs and state) gives the whole prompt's outputs; a frozen entry is read, not extended."""
    _, ours = _nemotron(8)
    x = torch.randn(2, 45, 32, generator=torch.Generator().manual_seed(8))

    class Cache:
        def __init__(self):
            self.entry = MambaState()

        def entry_of(self, module):
            return self.entry

    cache = Cache()
    state = ForwardState(cache=cache)
    with torch.no_grad():
        whole = ours(x)
        parts = [ours(x[:, :2], state), ours(x[:, 2:3], state), ours(x[:, 3:30], state), ours(x[:, 30:], state)]
        assert max_diff(torch.cat(parts, dim=1), whole) <= 1e-5
        assert cache.entry.conv.shape == (2, 3, HEADS * D_HEAD + 2 * GROUPS * D_STATE)
        assert cache.entry.state.shape == (2, HEADS, D_HEAD, D_STATE)
        kept = cache.entry.state.clone()
        cache.entry.frozen = True
        ours(x[:, :4], state)
        assert torch.equal(cache.entry.state, kept)


def test_hooks_see_the_scan_inputs_and_the_state_on_request():
    from lenskit.observe.hooks import HookedRootModule

    _, ours = _nemotron(9)

    class Root(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.attn = ours
            self.setup_hooks()

    root, x = Root(), torch.randn(2, 40, 32)
    seen = {}
    save = lambda t, hook: seen.__setitem__(hook.name, t)  # noqa: E731
    with torch.no_grad(), root.hooks([(n, save) for n in root.hook_dict]):
        root.attn(x)
    conv_dim = HEADS * D_HEAD + 2 * GROUPS * D_STATE
    assert seen["attn.hook_in_proj"].shape == (2, 40, HEADS * D_HEAD + conv_dim + HEADS)
    assert seen["attn.hook_conv"].shape == (2, 40, conv_dim)
    assert seen["attn.hook_B"].shape == seen["attn.hook_C"].shape == (2, 40, GROUPS, D_STATE)
    assert seen["attn.hook_gate"].shape == seen["attn.hook_ssm_out"].shape == (2, 40, HEADS, D_HEAD)
    dt = seen["attn.hook_dt"]
    assert dt.shape == (2, 40, HEADS) and bool((dt > 0).all())
    xs = seen["attn.hook_conv"][..., :HEADS * D_HEAD].view(2, 40, HEADS, D_HEAD)
    y, state = recurrent_scan(xs, dt, -ours.A_log.exp(), seen["attn.hook_B"], seen["attn.hook_C"])
    assert max_diff(seen["attn.hook_ssm_out"], y + xs * ours.D[:, None]) <= 1e-5
    assert seen["attn.hook_state"].shape == (2, HEADS, D_HEAD, D_STATE) and max_diff(seen["attn.hook_state"], state) <= 1e-5
    # an edit of the step sizes reaches the output: no step writes nothing, so only the D skip is left
    with torch.no_grad(), root.hooks([("attn.hook_dt", lambda t, hook: torch.zeros_like(t))]):
        skip_only = root.attn(x)
    ours.D.data.zero_()
    with torch.no_grad(), root.hooks([("attn.hook_dt", lambda t, hook: torch.zeros_like(t))]):
        assert root.attn(x).abs().max() == 0 and skip_only.abs().max() > 0


def test_bf16_mixer_rounds_as_transformers_does():
    """In bf16 the scan still runs in fp32: the outputs agree to bf16's rounding."""
    hf, ours = _nemotron(10)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    with torch.no_grad():
        got, want = ours(x), hf(x)
    assert got.dtype == torch.bfloat16 and max_diff(got, want) <= 2e-2 * want.abs().max().item()


def test_counts_are_the_modules_own():
    """params counts exactly the mixer's parameters; the core's FLOPs per token do not depend on the context."""
    for extra in ({}, dict(mamba_in_bias=True, mamba_out_bias=True, mamba_conv_bias=False), dict(mamba_norm="gate_only")):
        cfg = _cfg(**extra)
        ours = Mamba2Mixer(cfg)
        (weights, biases), norms = Mamba2Mixer.params(cfg)["attn"], Mamba2Mixer.params(cfg)["norms"][0]
        assert weights + biases + norms == sum(p.numel() for p in ours.parameters())
        assert norms == sum(p.numel() for p in ours.norm.parameters())
    assert Mamba2Mixer.core_flops(cfg, 0, 10) == Mamba2Mixer.core_flops(cfg, 0, 10_000)


def test_bad_mamba_settings_are_refused_by_name():
    for bad, match in ((dict(mamba_n_groups=3), "mamba_n_heads=8 is not a multiple of mamba_n_groups=3"),
                       (dict(mamba_d_state=0), "mamba_d_state must be a positive int"),
                       (dict(mamba_dt_min=0.5, mamba_dt_max=0.1), "mamba_dt_min=0.5 must be finite and <="),
                       (dict(mamba_norm="layer"), "mamba_norm='layer'"),
                       (dict(mamba_multipliers=(1.0, 2.0)), "mamba_multipliers must be a tuple of 5")):
        with pytest.raises(ValueError, match=match):
            _cfg(**bad)
