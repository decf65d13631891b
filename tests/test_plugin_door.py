"""Plugins import cpullm through one door: the in-tree plugins and the worked third-party examples
name only ``cpullm.plugin`` (and the public ``cpullm.load``), and every name that door lists exists."""
from __future__ import annotations

import re
from pathlib import Path

import cpullm.plugin

REPO = Path(__file__).resolve().parent.parent
PLUGIN_SOURCES = sorted([*REPO.glob("plugins/*/cpullm_*/**/*.py"),
                         *REPO.glob("tests/third_party/*/**/*.py")])
OTHER_DOOR = re.compile(r"^\s*(from cpullm(\.(?!plugin\b)\w+)* import|import cpullm\.)", re.M)


def test_plugins_import_only_cpullm_plugin():
    assert len(PLUGIN_SOURCES) > 20
    offenders = {str(p.relative_to(REPO)): m.group(0).strip()
                 for p in PLUGIN_SOURCES for m in [OTHER_DOOR.search(p.read_text())] if m}
    assert offenders == {}


def test_every_listed_name_exists():
    missing = [name for name in cpullm.plugin.__all__ if getattr(cpullm.plugin, name, None) is None]
    assert missing == []
    assert cpullm.plugin.testing.check_parity is not None     # the conformance kit, imported lazily
