"""Each registered family lives in its own module, `lenskit.families.<model_type>`, which holds all of its parts: the
config reader and writer, the checkpoint layout, the presets, the tiny test config and the record made of them; and
the tests build each family from that module's tiny config (docs/architecture.md, "Adding a family")."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import transformers
from conftest import FAMILY_CONFIGS
from families import FAMILY_BUILDERS

import lenskit.families
from lenskit.families import FAMILIES, config_fields
from lenskit.families.family import Family
from lenskit.families.layouts import Layout


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_family_is_one_module_with_every_part(model_type):
    module = importlib.import_module(f"lenskit.families.{model_type}")
    record = FAMILIES[model_type]
    assert isinstance(module.FAMILY, Family) and module.FAMILY is record and record.model_type == model_type
    assert record.read is module.read and record.read.__module__ == module.__name__
    assert record.write is module.write and record.write.__module__ == module.__name__
    assert record.layout is module.LAYOUT and isinstance(record.layout, Layout)
    assert record.presets is module.PRESETS and record.presets, f"{model_type} has no presets"
    assert all(cfg.family == model_type and cfg.name == name for name, cfg in record.presets.items())
    assert record.tiny is module.TINY
    assert f"`{model_type}`" in module.__doc__  # its docstring names what it is the home of


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_tests_build_each_family_from_its_modules_tiny_config(model_type):
    module = importlib.import_module(f"lenskit.families.{model_type}")
    config_class, model_class, kwargs = FAMILY_CONFIGS[model_type]
    assert kwargs == dict(module.TINY) and model_type in FAMILY_BUILDERS
    assert (config_class, model_class) == (module.FAMILY.hf_config_class, module.FAMILY.hf_class)
    # the tiny config is one transformers' class accepts and lenskit's reader reads as this family
    hf_config = getattr(transformers, config_class)(**{**kwargs, **module.FAMILY.tiny_3_blocks})
    assert hf_config.model_type == model_type
    assert config_fields(hf_config.to_dict())["family"] == model_type


def test_every_family_module_is_registered_and_every_other_module_is_shared():
    names = [m.name for m in pkgutil.iter_modules(lenskit.families.__path__)]
    with_a_record = {n for n in names if hasattr(importlib.import_module(f"lenskit.families.{n}"), "FAMILY")}
    assert with_a_record == set(FAMILIES)  # no family module left out of the registry, none registered from elsewhere
    shared = set(names) - with_a_record
    assert shared == {"family", "fields", "layouts", "presets", "readers", "rope", "writers"}, shared
