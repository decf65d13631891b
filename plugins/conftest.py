"""The family tests in plugins/<family>/tests run with the core suite's setup: tests/conftest.py
(the repository root kept off sys.path, tests/ on it for the shared helpers hf_reference,
tiny_configs and realmodels, the tests' own numba cache), loaded here under its own name because
a test run may start from this folder alone."""
import importlib.util
from pathlib import Path

_SUITE = Path(__file__).resolve().parent.parent / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("cpullm_suite_conftest", _SUITE)
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)

session_cache_dir = _suite.session_cache_dir
_isolated_cache = _suite._isolated_cache
pytest_collection_modifyitems = _suite.pytest_collection_modifyitems
