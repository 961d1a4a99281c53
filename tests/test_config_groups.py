"""ModelConfig's grouped settings: at most 40 top-level fields, frozen groups, the flat keywords and the groups building
the same config, the flat names as read-only aliases, and no import circle through lenskit.families."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from lenskit import PRESETS, ModelConfig
from lenskit.config import FLAT_NAMES, GROUPS, AttentionConfig, RopeConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_at_most_40_top_level_fields_and_every_group_frozen():
    fields = dataclasses.fields(ModelConfig)
    assert len(fields) <= 40, [f.name for f in fields]
    assert {f.name for f in fields if f.name in GROUPS} == set(GROUPS)
    for name, cls in GROUPS.items():
        assert cls.__dataclass_params__.frozen, name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cls(), dataclasses.fields(cls)[0].name, None)
    cfg = ModelConfig.from_name("gpt2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rope = RopeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):  # the flat alias reads, never writes
        cfg.rope_factor = 2.0


def test_flat_names_cover_every_group_setting_once():
    places = list(FLAT_NAMES.values())
    assert len(places) == len(set(places))
    assert set(places) == {(g, f.name) for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    top = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not top & set(FLAT_NAMES)  # a flat keyword never shadows a top-level field


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flat_keywords_and_groups_build_the_same_config(name):
    preset = PRESETS[name]
    flat = preset.to_flat_dict()
    assert len(flat) == len(dataclasses.fields(ModelConfig)) - len(GROUPS) + len(FLAT_NAMES)
    top = {f.name: getattr(preset, f.name) for f in dataclasses.fields(ModelConfig) if f.name not in GROUPS}
    grouped = ModelConfig(**top, **{g: getattr(preset, g) for g in GROUPS})
    assert ModelConfig(**flat) == grouped == preset
    assert ModelConfig(**dataclasses.asdict(preset)) == preset  # the groups as nested dicts
    assert dataclasses.replace(preset) == preset
    for key, (group, setting) in FLAT_NAMES.items():  # each alias reads its group's value
        assert getattr(preset, key) == getattr(getattr(preset, group), setting) == flat[key], key


def test_a_flat_keyword_and_a_group_change_alike():
    llama = ModelConfig.from_name("llama-3.2-1b")
    by_name = llama.replace(rope_factor=4.0)
    by_group = llama.replace(rope=dataclasses.replace(llama.rope, factor=4.0))
    assert by_name == by_group == dataclasses.replace(llama, rope_factor=4.0)
    assert by_name.rope.factor == 4.0 and by_name.rope.base == llama.rope.base
    # a flat keyword beside its group wins (dataclasses.replace passes both)
    assert ModelConfig(2, 64, 4, 100, 32, rope=RopeConfig(base=5.0), rotary_base=7.0).rope.base == 7.0
    # derived values in a group follow: rotary_dim keeps Pythia's quarter of d_head
    pythia = ModelConfig.from_name("pythia-70m")
    assert pythia.rope.dim == pythia.d_head // 4
    assert pythia.replace(d_head=32).rope.dim == 8


def test_bad_keywords_are_refused_in_one_line():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'rope_factr'.*rope_factor") as e:
        ModelConfig(2, 64, 4, 100, 32, rope_factr=2.0)
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match=r"ModelConfig.attention has no setting 'soft_cap'.*softcap"):
        ModelConfig(2, 64, 4, 100, 32, attention={"soft_cap": 3.0})
    with pytest.raises(TypeError, match=r"ModelConfig.rope must be a RopeConfig"):
        ModelConfig(2, 64, 4, 100, 32, rope=AttentionConfig())
    with pytest.raises(TypeError, match="missing required argument"):
        ModelConfig(2, 64)
    with pytest.raises(ValueError, match=r"ModelConfig.rope_factor must be a positive finite number"):  # flat names
        ModelConfig(2, 64, 4, 100, 32, rope=RopeConfig(factor=-1.0))


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports when it runs, at any depth (not those for the type checker only), as absolute names."""
    package = "lenskit." + ".".join(path.relative_to(ROOT / "lenskit").with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.rstrip(".").rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_config_never_imports_the_families():
    """lenskit.families registers into lenskit.config; config and its checks and names import none of it."""
    for module in ("config", "config_checks", "config_names"):
        imported = _imports(ROOT / "lenskit" / f"{module}.py")
        assert not any(m == "lenskit.families" or m.startswith("lenskit.families.") for m in imported), module
        if module != "config":
            assert "lenskit.config" not in imported, module


# `cfg` in these is not a ModelConfig (TransformerLens's own config), so its flat names are its own fields.
NOT_MODEL_CONFIGS = {"lenskit/transformer_lens/HookedTransformerConfig.py"}


def test_lenskit_reads_grouped_settings_through_their_group():
    """Inside lenskit/ and lenses/ a grouped setting is read as `cfg.rope.factor`, never by its flat alias
    (config_rename.py rewrites such reads)."""
    flat_reads = []
    for path in sorted([*ROOT.joinpath("lenskit").rglob("*.py"), *ROOT.joinpath("lenses").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in NOT_MODEL_CONFIGS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in FLAT_NAMES:
                receiver = ast.unparse(node.value)
                if receiver == "cfg" or receiver.endswith(".cfg"):
                    flat_reads.append(f"{rel}:{node.lineno} {receiver}.{node.attr}")
    assert not flat_reads, flat_reads
