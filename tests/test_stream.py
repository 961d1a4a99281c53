"""lenskit.Stream: parsing, validation with one negative rule, ordering, hook names, and every API that takes one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from references import resid_writes

import lenskit
from lenses import LogitLens, TunedLens
from lenskit import Stream
from lenskit.intervene.interventions import Attn, ablation_hooks
from lenskit.intervene.patching import patching_hooks
from lenskit.observe.stream import check_layer, stream_hook_names, streams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(model):
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return tokens, *model.run_with_cache(tokens)


def test_parse_what_users_type():
    assert Stream.parse(3) == Stream(3) == Stream(3, "resid_pre")
    assert Stream.parse("3") == Stream(3) and Stream.parse(" -1 ") == Stream(-1)
    assert Stream.parse("resid_mid.3") == Stream(3, "resid_mid") == Stream.parse("resid_mid:3")
    assert Stream.parse("blocks.2.hook_mlp_out") == Stream(2, "mlp_out")
    assert Stream.parse("4", point="attn_out") == Stream(4, "attn_out")
    s = Stream(1, "resid_post")
    assert Stream.parse(s) is s and Stream.parse(str(s)) == s
    for bad, err in [("three", ValueError), ("resid_mid.", ValueError), ("resid_middle.3", ValueError),
                     ("blocks.1.attn.hook_z", ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(err):
            Stream.parse(bad)
    with pytest.raises(ValueError, match="already names its point"):
        Stream.parse("resid_mid.3", point="attn_out")
    with pytest.raises(KeyError, match="unknown residual point 'x'"):  # a KeyError and a ValueError both
        Stream(0, "x")
    with pytest.raises(TypeError, match="must be an int"):
        Stream("3")  # type: ignore[arg-type]


def test_frozen_hashable_and_ordered_by_depth():
    s = Stream(2, "resid_mid")
    with pytest.raises(AttributeError):
        s.layer = 3  # type: ignore[misc]
    assert len({Stream(1), Stream.parse("1"), Stream(1, "resid_mid")}) == 2
    shuffled = [Stream(2), Stream(1, "resid_post"), Stream(0, "mlp_out"), Stream(1, "attn_out"), Stream(1),
                Stream(1, "resid_mid"), Stream(0, "resid_pre")]
    assert sorted(shuffled) == [Stream(0), Stream(0, "mlp_out"), Stream(1), Stream(1, "attn_out"), Stream(1, "resid_mid"),
                                Stream(1, "resid_post"), Stream(2)]
    assert Stream(1, "resid_post") < Stream(2) and max(shuffled) == Stream(2)


def test_one_negative_rule_and_the_final_stream():
    n = 6
    assert check_layer(-1, n) == 5 and check_layer(-6, n) == 0 and check_layer(6, n, final=True) == 6
    assert Stream(-1).resolve(n) == Stream(5) and Stream(-2, "mlp_out").resolve(n) == Stream(4, "mlp_out")
    assert Stream(6).hook_name(n) == "blocks.5.hook_resid_post"  # the stream after every block
    assert Stream(-1, "resid_mid").hook_name(n) == "blocks.5.hook_resid_mid"
    assert Stream(2, "resid_post").canonical() == Stream(3) and Stream(2, "attn_out").canonical() == Stream(2, "attn_out")
    with pytest.raises(IndexError, match=r"layer 6 is out of range: expected 0\.\.5"):
        Stream(6, "resid_mid").resolve(n)
    with pytest.raises(IndexError, match=r"layer 7 is out of range: expected 0\.\.6"):
        Stream(7).resolve(n)
    with pytest.raises(IndexError, match="-7 is out of range"):
        Stream(-7).resolve(n)


def test_stream_lists():
    assert streams(2) == [Stream(0), Stream(1), Stream(2)]
    assert streams(2, ("resid_pre", "resid_mid")) == [Stream(0), Stream(0, "resid_mid"), Stream(1), Stream(1, "resid_mid"), Stream(2)]
    assert stream_hook_names(2, "mlp_out") == ["blocks.0.hook_mlp_out", "blocks.1.hook_mlp_out"]
    assert resid_writes(1) == ["blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid",
                               "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post"]


def test_cache_reads_a_stream(model, run):
    _, _, cache = run
    n = model.cfg.n_layers
    assert cache.stream(2) is cache["blocks.2.hook_resid_pre"]
    assert cache.stream(n) is cache[f"blocks.{n - 1}.hook_resid_post"]
    assert cache.stream("resid_mid.1") is cache["resid_mid", 1] is cache[Stream(1, "resid_mid")]
    assert cache.stream(-1) is cache["resid_pre", -1]  # the same negative rule as the short names
    for l in range(n + 1):
        assert torch.equal(cache.stream(l), cache.accumulated_resid()[l])


def test_lenses_take_a_stream_or_an_int(model, run):
    _, _, cache = run
    n = model.cfg.n_layers
    logit = LogitLens(model)
    h = cache.stream(Stream(1, "resid_mid"))
    with torch.no_grad():
        torch.testing.assert_close(logit(h, Stream(1, "resid_mid")), model.readout(h))
        assert torch.equal(logit(cache.stream(2), 2), logit(cache.stream(2), Stream(2)))
        assert torch.equal(logit(cache.stream(n - 1), -1), logit(cache.stream(n - 1), n - 1))
        assert torch.equal(logit.decode(cache, "mlp_out.0"), model.readout(cache["mlp_out", 0]))
        tuned = TunedLens(model, resid_mid=True)
        for p in tuned.parameters():
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
        # resid_post of block 0 is the stream after one block: the same translator as Stream(1)
        post = cache["resid_post", 0]
        assert torch.equal(tuned(post, Stream(0, "resid_post")), tuned(post, 1))
        t = tuned.mid_translators[1]
        torch.testing.assert_close(tuned(h, "resid_mid.1"), model.readout(h + t(h)))
    with pytest.raises(ValueError, match="LogitLens for sublayer writes"):
        tuned(cache["attn_out", 0], Stream(0, "attn_out"))


def test_patching_and_ablation_take_a_stream(model, run):
    tokens, _, cache = run
    by_site = patching_hooks(model, cache, "resid_mid", 1, positions=[0])
    by_stream = patching_hooks(model, cache, Stream(1, "resid_mid"), positions=[0])
    assert [n for n, _ in by_site] == [n for n, _ in by_stream] == ["blocks.1.hook_resid_mid"]
    other = torch.flip(tokens, dims=[0])
    with torch.no_grad():
        assert torch.equal(model.run_with_hooks(other, fwd_hooks=by_site), model.run_with_hooks(other, fwd_hooks=by_stream))
        ablated = model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, Stream(1, "attn_out")))
        assert torch.equal(ablated, model.run_with_hooks(tokens, fwd_hooks=ablation_hooks(model, Attn(1))))
    with pytest.raises(ValueError, match="already names its layer"):
        patching_hooks(model, cache, Stream(1), 1)


def test_the_stream_hook_pattern_lives_in_one_module():
    """Only lenskit/observe/stream.py spells residual-stream hook names; every other module asks a Stream."""
    pattern = re.compile(r"hook_(resid_pre|resid_mid|resid_post|attn_out|mlp_out)")
    spelled = []
    for path in sorted((ROOT / "lenskit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and id(n) not in docstrings]
        if any(pattern.search(s) for s in strings):
            spelled.append(path.relative_to(ROOT).as_posix())
    assert spelled == ["lenskit/observe/stream.py"]


def test_no_private_name_is_imported_across_modules():
    offenders = []
    for folder in ("lenskit", "lenses", "experiments", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                                  if a.name.startswith("_") and a.name != "__version__"]
    assert not offenders


def test_lenskit_exposes_its_modules():
    for name, module in (("interventions", "lenskit.intervene.interventions"), ("patching", "lenskit.intervene.patching"),
                         ("data", "lenskit.io.data"), ("accounting", "lenskit.accounting")):
        assert getattr(lenskit, name).__name__ == module
    assert lenskit.Stream is Stream
