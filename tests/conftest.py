import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

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
