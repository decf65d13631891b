"""Registry coverage: every installed family ships a tiny config (``FamilySpec.tiny_config``) and
the conformance kit passes on a random checkpoint of it, so no family is installed untested."""
from __future__ import annotations

import pytest

from cpullm.loading import plugins
from cpullm import testing
from cpullm.loading.family import FamilySpec
from cpullm.hookspecs import hookimpl

INSTALLED = sorted(f.name for f in plugins.discover().families)


def test_every_installed_family_ships_a_tiny_config():
    assert INSTALLED, "no family plugin is installed"
    missing = testing.families_without_tiny_config()
    assert not missing, (f"families without FamilySpec.tiny_config: {', '.join(missing)}; "
                         "ship a tiny config.json of each family (cpullm.loading.family.FamilySpec)")


@pytest.mark.filterwarnings("ignore:no reference_logits:cpullm.testing.ConformanceWarning")
@pytest.mark.parametrize("name", INSTALLED)
def test_conformance_kit_passes_on_the_family_s_tiny_config(name, tmp_path):
    family = next(f for f in plugins.discover().families if f.name == name)
    assert family.tiny_config, f"{family.plugin}:{name} ships no tiny_config"
    report = testing.run_family_conformance(family.tiny_config, tmp_path, family=name)
    assert report["family"] == name and report["plugin"] == family.plugin
    assert report["int8"]["cosine"] >= testing.INT8_MIN_COSINE


def test_a_family_without_a_tiny_config_fails_the_coverage_check():
    pytest.importorskip("cpullm_llama", reason="the sample family borrows the llama plugin's code")
    llama = next(f for f in plugins.discover().families if f.name == "llama")
    untested = FamilySpec(name="untested", model_types=("untested",), args_class=llama.args_class,
                          weight_map=llama.weight_map, build_graph=llama.build_graph)

    class UntestedFamilyPlugin:
        @staticmethod
        @hookimpl
        def cpullm_families():
            return [untested]

    plugins.register_for_tests(UntestedFamilyPlugin)
    try:
        reg = plugins.discover(refresh=True)
        assert testing.families_without_tiny_config(reg) == ["UntestedFamilyPlugin:untested"]
    finally:
        plugins.unregister_for_tests(UntestedFamilyPlugin)
        plugins.discover(refresh=True)
