import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _keep_the_repository_root_off_sys_path() -> None:
    """The repository root holds folders named like installable packages (kernels/, core/, ...).

    `python -m pytest` puts the working directory first on sys.path, so `import kernels` (which
    transformers does) would find the project's kernels/ folder instead of the installed package
    of that name, and a folder named cpullm/ in the working directory would hide cpullm itself.
    cpullm and its plugins are imported from their installs (cpullm.kernels is kernels/), so the
    working directory and the root leave sys.path before anything else is imported, and a module
    already imported from a root folder under its bare name is forgotten.
    """
    cwd = Path.cwd().resolve()
    sys.path[:] = [p for p in sys.path
                   if p not in ("", os.curdir) and Path(p).resolve() not in (REPO, cwd)]
    root_folders = {p.name for p in REPO.iterdir() if p.is_dir()}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        places = [file] if file else list(getattr(module, "__path__", []))   # namespace: __path__
        if name.partition(".")[0] in root_folders and \
                any(Path(p).resolve().is_relative_to(REPO) for p in places):
            del sys.modules[name]
    # Python processes the tests start inherit the same rule (Python 3.11+: no working directory
    # or script folder on their sys.path).
    os.environ["PYTHONSAFEPATH"] = "1"


_keep_the_repository_root_off_sys_path()
sys.path.insert(0, str(HERE))     # the tests' helper modules (tiny_configs, realmodels, ...)

import pytest  # noqa: E402

# Tests never touch the user's caches.
os.environ.setdefault("CPULLM_QUIET", "1")


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("exec_cache")
    os.environ["CPULLM_CACHE_DIR"] = str(d)
    return d


@pytest.fixture(autouse=True)
def _isolated_cache(session_cache_dir):
    yield


def pytest_collection_modifyitems(config, items):
    # Slow (real-model) tests run last so quick failures surface first.
    items.sort(key=lambda it: 1 if it.get_closest_marker("slow") else 0)
