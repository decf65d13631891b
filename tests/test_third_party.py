"""Third-party plugins end to end, the way a user meets them.

The packages under ``tests/third_party/`` are pip-installed (offline, no build isolation) into a
throwaway virtual environment whose sys.path continues with the site directories of the
interpreter running the tests (a .pth file), so numpy, numba, pip, setuptools and the editable
cpullm are visible, whether the tests run in a virtual environment or not, while the plugins
live only in the throwaway one. Every command runs as a subprocess
of that environment's python: ``cpullm families`` lists the plugin, ``cpullm run`` generates with
it, its own test suite (the conformance kit against its numpy reference) passes, a plugin that
raises on import is listed with its error while the rest works, two plugins claiming one
model_type resolve by the documented precedence with a warning, and uninstalling removes it.

The numba cache lives beside the kernel sources, so the subprocesses load compiled kernels.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

THIRD_PARTY = Path(__file__).parent / "third_party"
VARIANT = "cpullm-plugin-tinyvariant"
FAST = "cpullm-plugin-tinyvariant-fast"
BROKEN = "cpullm-plugin-broken"

CONFIG = dict(   # a tiny tinyllama_variant checkpoint; no eos id, so generation runs to -n
    model_type="tinyllama_variant", architectures=["TinyLlamaVariantForCausalLM"],
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, max_position_embeddings=256,
    tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


class Env:
    """A virtual environment beside cpullm, and the plugin sources copied next to it."""

    def __init__(self, root: Path):
        self.root = root
        self.venv = root / "venv"
        bindir = "Scripts" if os.name == "nt" else "bin"
        self.python = self.venv / bindir / ("python.exe" if os.name == "nt" else "python")
        self.src = root / "src"
        self.env = dict(os.environ, CPULLM_CACHE_DIR=str(root / "exec_cache"), PIP_NO_INDEX="1",
                        PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1", PIP_USER="0")
        self.env.pop("PYTHONPATH", None)
        self.env.pop("CPULLM_QUIET", None)
        self.installed: set[str] = set()

    def run(self, *args, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.python), *map(str, args)], capture_output=True, text=True,
                              env=self.env, cwd=cwd or self.root, timeout=600)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def pip_install(self, *dists: str):
        self.run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                 *(self.src / d for d in dists))
        self.installed.update(dists)

    def pip_uninstall(self, *dists: str):
        self.run("-m", "pip", "uninstall", "-y", "-q", *dists)
        self.installed.difference_update(dists)

    def ensure(self, *dists: str):
        missing = [d for d in dists if d not in self.installed]
        if missing:
            self.pip_install(*missing)

    def cpullm(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("-m", "cpullm.cli", *args, check=check)

    def families(self) -> dict:
        out = json.loads(self.cpullm("families", "--json").stdout)
        out["by_plugin"] = {p["plugin"]: p for p in out["plugins"]}
        return out


def see_the_running_interpreter_s_packages(e: Env) -> None:
    """Make the venv's sys.path continue with this interpreter's site directories.

    A venv created from inside another venv is based on the base interpreter, so
    --system-site-packages would show the base's packages, not the ones running these tests.
    site.addsitedir also runs those directories' .pth files, which is how editable installs
    (cpullm itself, here) put themselves on sys.path.
    """
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    purelib = e.run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs)
    (Path(purelib) / "_outer_site_packages.pth").write_text(line + "\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("third_party")
    e = Env(root)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(e.venv)],
                   check=True, capture_output=True, timeout=300)
    see_the_running_interpreter_s_packages(e)
    if e.run("-m", "pip", "--version", check=False).returncode != 0:   # no pip beside cpullm
        if e.run("-m", "ensurepip", "-q", check=False).returncode != 0:
            pytest.skip("pip is not available to the virtual environment")
    # --no-build-isolation builds with the setuptools seen here; bdist_wheel is built in from 70.1.
    e.run("-c", "import setuptools.command.bdist_wheel")
    # The environment runs the cpullm under test: when the base environment's cpullm is another
    # checkout (this one is installed in a virtual environment of its own), install this one.
    repo = Path(__file__).resolve().parents[1]
    probe = e.run("-c", "import cpullm, pathlib; print(pathlib.Path(cpullm.__file__).resolve().parents[1])",
                  check=False)
    if probe.stdout.strip() != str(repo):
        e.run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", repo)
    # Build from copies: pip's in-tree build must not leave build/ and *.egg-info in the repo.
    shutil.copytree(THIRD_PARTY, e.src, ignore=shutil.ignore_patterns(
        "__pycache__", "build", "*.egg-info", ".pytest_cache"))
    # The packages must not already be importable from the base environment.
    probe = e.run("-c", "import importlib.util as u; print(u.find_spec('cpullm_tinyvariant'))")
    assert probe.stdout.strip() == "None", "cpullm_tinyvariant is already installed system-wide"
    e.pip_install(VARIANT)
    return e


@pytest.fixture(scope="module")
def checkpoint(env):
    """A tiny random tinyllama_variant checkpoint, written by the plugin's own environment."""
    d = env.root / "tiny_variant"
    env.run("-c", "import json, sys; from cpullm.testing import make_random_checkpoint; "
                  "make_random_checkpoint(json.loads(sys.argv[1]), sys.argv[2], std=0.3)",
            json.dumps(CONFIG), d)
    return d


def test_families_lists_the_installed_plugin(env):
    env.ensure(VARIANT)
    fams = env.families()
    info = fams["by_plugin"][VARIANT]
    assert info["error"] is None
    assert info["version"] == "0.1.0" and info["module"] == "cpullm_tinyvariant.plugin"
    assert [(f["name"], f["model_types"]) for f in info["families"]] == \
        [("tinyvariant", ["tinyllama_variant"])]
    assert fams["by_plugin"]["cpullm-plugin-llama"]["error"] is None
    assert fams["conflicts"] == []


def test_run_generates_with_the_installed_plugin(env, checkpoint):
    env.ensure(VARIANT)
    proc = env.cpullm("run", checkpoint, "-p", "Hello", "-n", "6", "--json")
    out = json.loads(proc.stdout)
    assert out["family"] == "tinyvariant"
    assert out["generated_tokens"] == 6 and out["stop_reason"] == "length"
    assert isinstance(out["text"], str)


def test_the_plugin_s_own_conformance_suite_passes(env):
    """What the author runs: pytest over the package's tests/, with cpullm.testing inside."""
    env.ensure(VARIANT)
    pkg = env.src / VARIANT
    proc = env.run("-m", "pytest", "-q", "-p", "no:cacheprovider",
                   pkg / "tests", cwd=pkg, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


def test_broken_plugin_and_conflicting_plugin(env, checkpoint):
    env.ensure(VARIANT)
    env.pip_install(BROKEN, FAST)
    try:
        fams = env.families()
        broken = fams["by_plugin"][BROKEN]
        assert broken["families"] == []
        assert broken["error"] == ("ImportError: cpullm-plugin-broken needs libfrobnicate, "
                                   "which is not installed")
        for name in ("cpullm-plugin-llama", VARIANT, FAST):     # the rest is unaffected
            assert fams["by_plugin"][name]["error"] is None, fams["by_plugin"][name]
        # Both claim tinyllama_variant: priority 1 beats 0, recorded and warned, never silent.
        # (The fast plugin also claims the same architectures name: a second, alike conflict.)
        conflict, arch = fams["conflicts"]
        assert conflict.startswith("model_type 'tinyllama_variant' is claimed by "
                                   f"{FAST}:tinyvariant_fast (priority 1) and {VARIANT}:tinyvariant")
        assert conflict.endswith(f"using {FAST}:tinyvariant_fast (higher priority, then plugin name order)")
        assert arch.startswith("architecture 'TinyLlamaVariantForCausalLM' is claimed by")

        text = env.cpullm("families")
        assert f"{BROKEN} 0.0.1  [failed to load: ImportError: cpullm-plugin-broken needs" in text.stdout
        assert f"warning: {conflict}" in text.stdout

        proc = env.cpullm("run", checkpoint, "-p", "Hello", "-n", "4", "--json")
        assert json.loads(proc.stdout)["family"] == "tinyvariant_fast"
        assert f"PluginConflictWarning: {conflict}" in proc.stderr
        assert "libfrobnicate" not in proc.stderr          # a broken plugin never breaks a run
    finally:
        env.pip_uninstall(BROKEN, FAST)
    fams = env.families()
    assert BROKEN not in fams["by_plugin"] and FAST not in fams["by_plugin"]
    assert fams["conflicts"] == []


def test_uninstall_removes_the_family(env, checkpoint):
    env.ensure(VARIANT)
    env.pip_uninstall(VARIANT)
    fams = env.families()
    assert VARIANT not in fams["by_plugin"]
    assert not any("tinyllama_variant" in f["model_types"]
                   for p in fams["plugins"] for f in p["families"])
    proc = env.cpullm("run", checkpoint, "-p", "Hello", "-n", "2", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("cpullm: error: model_type 'tinyllama_variant' is not handled by "
                                  "any installed family (installed: ")
    assert "Traceback" not in proc.stderr


NEOX, PHI3 = "cpullm-plugin-neox", "cpullm-plugin-phi3"
NEOX_CONFIG = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=256,
                   hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   max_position_embeddings=256, layer_norm_eps=1e-5, use_parallel_residual=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
PHI3_CONFIG = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], vocab_size=256, hidden_size=64,
                   intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=128, original_max_position_embeddings=32,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})


def test_plugins_with_their_own_op_and_rope_scaling(env):
    """Installed as a user would: the GPT-NeoX plugin's op and the Phi-3 plugin's longrope run in
    a fresh process, found through the entry points alone."""
    env.pip_install(NEOX, PHI3)
    try:
        fams = env.families()
        for dist, family in ((NEOX, "gpt_neox"), (PHI3, "phi3")):
            assert fams["by_plugin"][dist]["error"] is None
            assert [f["name"] for f in fams["by_plugin"][dist]["families"]] == [family]
        for name, config in (("gpt_neox", NEOX_CONFIG), ("phi3", PHI3_CONFIG)):
            d = env.root / f"tiny_{name}"
            env.run("-c", "import json, sys; from cpullm.testing import make_random_checkpoint; "
                          "make_random_checkpoint(json.loads(sys.argv[1]), sys.argv[2], std=0.3)",
                    json.dumps(config), d)
            out = json.loads(env.cpullm("run", d, "-p", "Hello", "-n", "4", "--json").stdout)
            assert out["family"] == name and out["generated_tokens"] == 4
    finally:
        env.pip_uninstall(NEOX, PHI3)


GPT2 = "cpullm-plugin-gpt2"


def test_gpt2_plugin_installed_runs_and_enforces_its_context_limit(env):
    """Installed as a user would: the GPT-2 plugin (Conv1D matrices through the TRANSPOSE shape
    rule, learned positions) generates in a fresh process, and a context past its position table
    is refused with one line naming the fix."""
    env.pip_install(GPT2)
    try:
        fams = env.families()
        assert fams["by_plugin"][GPT2]["error"] is None
        d = env.root / "tiny_gpt2"
        env.run("-c", "import json, sys; from cpullm.testing import make_random_checkpoint; "
                      "from cpullm.loading.plugins import discover; "
                      "make_random_checkpoint(discover().family_for({'model_type': 'gpt2'}).tiny_config, "
                      "sys.argv[1], std=0.3)", d)
        out = json.loads(env.cpullm("run", d, "-p", "Hello", "-n", "4", "--json").stdout)
        assert out["family"] == "gpt2" and out["generated_tokens"] == 4
        proc = env.cpullm("run", d, "-p", "Hello", "-n", "2", "--ctx", "129", check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("cpullm: error: n_ctx 129 is more than the 128 positions a gpt2 "
                                      "checkpoint can address; load with n_ctx <= 128")
    finally:
        env.pip_uninstall(GPT2)
