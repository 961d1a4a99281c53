"""Device maps and offload on the CPU (lenskit.placement): a map onto the CPU and offloaded blocks equal the plain
model bit for bit, accelerate's plan across two (pretend) GPUs keeps blocks whole and in order, and bad maps and
budgets are refused by name. The two-GPU runs are in tests/test_cuda.py."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from conftest import make_hf_family

from lenses import LogitLens, Trajectory
from lenses.cli import main as cli_main
from lenskit import HookedTransformer, ModelConfig
from lenskit.families import FAMILIES
from lenskit.intervene.interventions import Mlp, ablation_hooks
from lenskit.placement import Placement, placement_from_map, plan_device_map

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["gpt2", "llama"])  # tied and untied embeddings
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_family(request.param, **FAMILIES[request.param].tiny_3_blocks).save_pretrained(path)
    return path


def tokens_for(model: HookedTransformer) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(0))


def offloaded(model: HookedTransformer, layers: set[int]) -> Placement:
    """`model`'s placement with `layers` offloaded: weights where they are, computed on the CPU through the path
    that copies a block's weights to the compute device for one call."""
    n = model.cfg.n_layers
    return Placement(CPU, (CPU,) * n, CPU, CPU, frozenset(layers))


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"embed": "cpu", "blocks": "cpu", "ln_final": "cpu", "unembed": "cpu"},
                                        {"": "cpu", "blocks.1": "cpu"}])
def test_a_map_onto_the_cpu_is_the_plain_model_bit_for_bit_and_stays_mapped(folder, device_map):
    plain = HookedTransformer.from_pretrained(folder)
    mapped = HookedTransformer.from_pretrained(folder, device_map=device_map)
    assert mapped.placement is not None and mapped.placement.is_single and not mapped.placement.offloaded
    assert mapped.weight_files is not None  # the weights are still the checkpoint's pages, not copies
    tokens = tokens_for(plain)
    with torch.no_grad():
        want, want_cache = plain.run_with_cache(tokens)
        got, got_cache = mapped.run_with_cache(tokens)
    assert torch.equal(got, want) and set(got_cache) == set(want_cache)
    assert all(torch.equal(got_cache[k], want_cache[k]) for k in want_cache)


def test_offloaded_blocks_equal_the_plain_model_bit_for_bit(folder):
    plain = HookedTransformer.from_pretrained(folder)
    model = HookedTransformer.from_pretrained(folder)
    model.placement = offloaded(model, {0, 2})
    tokens = tokens_for(plain)
    with torch.no_grad():
        want, want_cache = plain.run_with_cache(tokens)
        got, got_cache = model.run_with_cache(tokens)
        assert torch.equal(got, want) and all(torch.equal(got_cache[k], want_cache[k]) for k in want_cache)
        hooks = ablation_hooks(plain, [Mlp(2)])  # interventions reach the hook points of an offloaded block
        assert torch.equal(model.run_with_hooks(tokens, hooks), plain.run_with_hooks(tokens, hooks))
        assert not torch.equal(plain.run_with_hooks(tokens, hooks), want)
        assert torch.equal(model(tokens, stop_at_layer=2), plain(tokens, stop_at_layer=2))
    got, want = (Trajectory.from_prompt(LogitLens(m), tokens) for m in (model, plain))
    assert torch.equal(got.top_ids, want.top_ids) and torch.equal(got.kl_to_final, want.kl_to_final)
    # gradients reach the offloaded block's own weights (the copy for the call is a differentiable .to())
    loss = model(tokens, return_type="loss")
    loss.backward()
    grad = model.blocks[0].attn.out.weight.grad
    plain(tokens, return_type="loss").backward()
    assert grad is not None and torch.equal(grad, plain.blocks[0].attn.out.weight.grad)


def test_the_plan_across_two_gpus_keeps_blocks_whole_in_order_and_loses_nothing():
    """accelerate's planner on the meta device (nothing allocated) with a budget across two pretend GPUs."""
    for name, budget in (("llama-3.1-8b", {0: "4GiB", 1: "6GiB", "cpu": "100GiB"}),
                         ("llama-3.2-1b", {"cuda:0": "2GiB", "cuda:1": "512MiB", "cpu": "64GiB"}),  # tied embeddings
                         ("gemma-2-2b", "cuda:0=4GiB,cuda:1=1GiB,cpu=64GiB")):
        cfg = ModelConfig.from_name(name)
        plan = plan_device_map(HookedTransformer, cfg, "auto", budget, dtype=torch.bfloat16)
        placement = placement_from_map(plan, cfg.n_layers)
        order = {"cuda:0": 0, "cuda:1": 1, "cpu": 2}
        ranks = [order[str(d)] for d in placement.blocks]
        assert ranks == sorted(ranks) and len(set(ranks)) == 3, (name, placement.table())  # in order, all three used
        assert placement.embed == torch.device("cuda:0") and placement.main == torch.device("cuda:0")
        assert placement.offloaded == {i for i, r in enumerate(ranks) if r == 2}
        if cfg.tie_word_embeddings:
            assert placement.readout == placement.embed
        rows = placement.table()
        covered = sum(int(r[0].split(".")[1].split("-")[-1]) - int(r[0].split(".")[1].split("-")[0]) + 1
                      for r in rows if r[0].startswith("blocks."))
        assert covered == cfg.n_layers  # every block placed exactly once


@pytest.mark.parametrize("device_map, message", [
    ({"": "cpu", "encoder": "cpu"}, "names 'encoder', which is not a part of the model"),
    ({"": "cpu", "blocks.7": "cpu"}, "names 'blocks.7', but the model has 3 blocks"),
    ({"": "cpu", "blocks.1.attn": "cpu"}, "splits block 1; a block is placed whole: use 'blocks.1'"),
    ({"embed": "cpu", "blocks.0": "cpu", "blocks.2": "cpu", "ln_final": "cpu", "unembed": "cpu"},
     "leaves blocks.1 unplaced"),
    ({"": "cpu", "blocks.2": "disk"}, "offload to disk is not implemented"),
    ({"": "cpu", "blocks.2": "tpu:9"}, "is not a device torch knows"),
    ({}, "non-empty {module prefix: device} dict"),
    ("everywhere", "expected one of ('auto'"),
])
def test_bad_device_maps_are_refused_by_name(folder, device_map, message):
    with pytest.raises(ValueError) as err:
        HookedTransformer.from_pretrained(folder, device_map=device_map)
    assert message in str(err.value) and "\n" not in str(err.value), err.value


def test_parts_of_one_unit_on_two_devices_and_other_misuse_are_refused():
    with pytest.raises(ValueError, match="puts 'unembed' on meta but 'ln_final' on cpu; they are one unit"):
        placement_from_map({"": "cpu", "unembed": "meta"}, 2)
    with pytest.raises(ValueError, match="puts 'pos_embed' on meta but 'embed' on cpu"):
        placement_from_map({"": "cpu", "pos_embed": "meta"}, 2)
    cfg = ModelConfig.from_name("llama-3.2-1b")  # tied: embed and unembed are one tensor
    from lenskit.placement import resolve_placement
    with pytest.raises(ValueError, match="tied to the unembedding.*cpu and meta"):
        resolve_placement(HookedTransformer, cfg, CPU, {"": "cpu", "ln_final": "meta", "unembed": "meta"}, None, torch.float32)
    with pytest.raises(ValueError, match="max_memory is a budget for device_map='auto'"):
        resolve_placement(HookedTransformer, cfg, CPU, None, {"cpu": "1GiB"}, torch.float32)


def test_device_and_device_map_together_are_refused(folder):
    with pytest.raises(ValueError, match="pass device='cpu' or device_map, not both"):
        HookedTransformer.from_pretrained(folder, device="cpu", device_map={"": "cpu"})


@pytest.mark.parametrize("budget, device", [({0: "10MiB", "cpu": "64GiB"}, "cuda:0"), ("cuda:1=1GiB,cpu=200MB", "cpu")])
def test_a_budget_too_small_for_one_block_says_so(budget, device):
    cfg = ModelConfig.from_name("llama-3.1-8b")  # one block: 218,112,000 params, 416 MiB in bf16
    with pytest.raises(ValueError) as err:
        plan_device_map(HookedTransformer, cfg, "auto", budget, dtype=torch.bfloat16)
    assert f"max_memory {device}=" in str(err.value) and "cannot hold one block (416.0 MiB in bfloat16)" in str(err.value)


@pytest.mark.parametrize("budget", ["cuda:0", "cuda:0=", "=5GiB", "cuda:0=lots"])
def test_a_malformed_budget_is_refused(budget):
    with pytest.raises(ValueError, match="max_memory"):
        plan_device_map(HookedTransformer, ModelConfig.from_name("gpt2"), "auto", budget)


def run_info(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["info", *args])
    return code, out.getvalue(), err.getvalue()


def test_info_prints_the_placement_and_refuses_a_budget_without_a_map():
    code, out, err = run_info("--model", "llama-3.1-8b", "--device-map", "auto",
                              "--max-memory", "cuda:0=6GiB,cuda:1=6GiB,cpu=100GiB")
    assert code == 0, err
    table = out[out.index("placement: --device-map auto"):]
    assert "embed     cuda:0" in table and "cuda:0 (offloaded)" in table and "cuda:1" in table
    code, out, err = run_info("--model", "llama-3.1-8b", "--max-memory", "cuda:0=6GiB")
    assert code == 2 and "--max-memory is a budget for --device-map" in err and len(err.strip().splitlines()) == 1
