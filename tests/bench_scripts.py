"""Load a script of benchmarks/ as a module by its path (the repository root stays off sys.path)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """benchmarks/<name>.py as the module ``cpullm_bench_<name>`` (``name`` may hold a folder:
    "compare/gguf")."""
    spec = importlib.util.spec_from_file_location(f"cpullm_bench_{name.replace('/', '_')}",
                                                  ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shell_tool(path: Path, body: str) -> str:
    """An executable /bin/sh script at ``path`` running ``body``: a stand-in for a llama.cpp tool
    (its arguments and output are what the test checks). Returns its path as a string."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)
