"""The repository's top-level folders never shadow an installed package, whatever starts pytest.

The root holds kernels/ (installed as cpullm_kernels), and transformers 5 imports a PyPI package
named ``kernels``. ``python -m pytest`` from the root puts the root first on sys.path, where that
folder would win if it were a package; none is (the packages are folders inside them:
core/cpullm/, kernels/cpullm_kernels/), so an installed package of its name comes first.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT_FOLDERS = sorted(p.name for p in REPO.iterdir()
                      if p.is_dir() and p.name.isidentifier() and not p.name.startswith("."))
SITE_ENV = "CPULLM_TEST_KERNELS_SITE"     # set by the subprocess test: where kernels must come from


def _places(spec) -> list[Path]:
    """The files or folders an import spec would load from (a namespace package has no origin)."""
    places = list(spec.submodule_search_locations or [])
    if spec.origin and spec.has_location:
        places.append(spec.origin)
    return [Path(p).resolve() for p in places]


def _shadows(spec, name: str) -> bool:
    """Whether ``spec`` loads the repository's root folder ``name`` as a module or regular
    package. A folder without ``__init__.py`` found on sys.path is only a namespace portion:
    any installed module or regular package of that name is found before it."""
    return spec is not None and spec.origin not in (None, "namespace") and \
        any(p.is_relative_to(REPO / name) for p in _places(spec))


def test_no_root_folder_is_importable_under_its_own_name():
    shadowing = {}
    for name in ROOT_FOLDERS:
        spec = importlib.util.find_spec(name)
        if _shadows(spec, name):
            shadowing[name] = spec.origin
    assert shadowing == {}
    assert "kernels" in ROOT_FOLDERS          # the folder the check above is mostly about


def test_kernels_is_the_installed_package():
    """Run by itself in the suite, and as the child of the test below with a stand-in package."""
    spec = importlib.util.find_spec("kernels")
    site = os.environ.get(SITE_ENV)
    if site is None:       # the real PyPI package (a transformers dependency; in the repository's
        # own .venv when scripts/test.sh made one there) or none at all
        assert not _shadows(spec, "kernels")
        return
    import kernels
    assert kernels.SOURCE == "the installed package", kernels.__file__
    assert Path(kernels.__file__).resolve().is_relative_to(Path(site).resolve())
    import cpullm_kernels  # the project's own folder, through its install
    assert Path(cpullm_kernels.__file__).resolve().is_relative_to(REPO / "kernels")


def test_python_m_pytest_from_the_root_imports_the_installed_kernels(tmp_path):
    """`python -m pytest` in the repository root, with a package named kernels installed in a
    site directory: the installed one is what `import kernels` finds inside the tests."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text('SOURCE = "the installed package"\n')
    env = dict(os.environ, PYTHONPATH=str(site), **{SITE_ENV: str(site)})
    env.pop("PYTHONSAFEPATH", None)          # the plain interpreter: working directory on sys.path
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).resolve()}::test_kernels_is_the_installed_package"],
        cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
