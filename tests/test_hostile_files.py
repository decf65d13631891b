"""Hostile model files, configs, indexes and cache entries: one regression test per reproduction.

Each input here once drove an allocation, a hang, a crash or a traceback. Now each one is refused
before anything is allocated from it, with a one-line cpullm.errors error (exit 2 in the CLI).
The inputs that used to exhaust memory run in a child process under an address-space limit, so a
regression fails the test instead of the machine.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cpullm import errors
from cpullm.cli import main
from cpullm.loading.family import read_config
from cpullm.loading.tensors import TensorStore
from cpullm.testing import make_random_checkpoint

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
            max_position_embeddings=64, tie_word_embeddings=True, rope_theta=10000.0)

CHILD_MEMORY_LIMIT = 3 << 30   # bytes of address space for a child process: numpy + numba fit in 1.5 GB


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return make_random_checkpoint(TINY, tmp_path_factory.mktemp("good"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _error_line(code: int, stderr: str) -> str:
    """The CLI's one error line: exit 2, the last line of stderr, no traceback (progress lines
    such as ``cpullm: convert: reading GGUF (0%)`` may come before it)."""
    lines = stderr.strip().splitlines()
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert [x for x in lines if x.startswith("cpullm: error:")] == lines[-1:], lines[-5:]
    return lines[-1]


def _one_error_line(capsys, argv) -> str:
    code = main(argv)
    return _error_line(code, capsys.readouterr().err)


def _run_cli_bounded(argv: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``cpullm ARGV`` in a child with at most CHILD_MEMORY_LIMIT bytes of address space."""
    code = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({CHILD_MEMORY_LIMIT}, {CHILD_MEMORY_LIMIT}))\n"
            "from cpullm.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    env = dict(os.environ, CPULLM_CACHE_DIR=str(tmp_path / "exec-cache"), CPULLM_QUIET="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=env)


def _assert_one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    return _error_line(proc.returncode, proc.stderr)


# ---------------------------------------------------------------------------------------------
# GGUF: metadata that asks for absurd sizes
# ---------------------------------------------------------------------------------------------

def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def metadata_only_gguf(path: Path, kv: list[tuple[str, int, bytes]]) -> Path:
    """A GGUF v3 file with no tensors and the given (key, value type, packed value) entries."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, vtype, value in kv:
        out += _gguf_string(key) + struct.pack("<I", vtype) + value
    path.write_bytes(out)
    return path


def test_227_byte_gguf_with_2_pow_40_layers_is_refused_without_allocating(tmp_path):
    path = metadata_only_gguf(tmp_path / "huge.gguf", [
        ("general.architecture", 8, _gguf_string("llama")),
        ("llama.block_count", 10, struct.pack("<Q", 2 ** 40)),
        ("llama.embedding_length", 4, struct.pack("<I", 64)),
        ("llama.attention.head_count", 4, struct.pack("<I", 4)),
        ("llama.feed_forward_length", 4, struct.pack("<I", 96)),
    ])
    assert path.stat().st_size == 227
    proc = _run_cli_bounded(["convert", str(path), str(tmp_path / "out")], tmp_path)
    line = _assert_one_line_exit_2(proc)
    assert "block_count" in line and "1024" in line
    assert not (tmp_path / "out").exists()


def _shape_kv(arch="llama", **override) -> list:
    """Metadata of a tiny llama, with entries replaced by ``override`` (key -> (type, packed))."""
    kv = {
        "general.architecture": (8, _gguf_string(arch)),
        f"{arch}.block_count": (4, struct.pack("<I", 2)),
        f"{arch}.embedding_length": (4, struct.pack("<I", 64)),
        f"{arch}.attention.head_count": (4, struct.pack("<I", 4)),
        f"{arch}.attention.head_count_kv": (4, struct.pack("<I", 2)),
        f"{arch}.feed_forward_length": (4, struct.pack("<I", 96)),
    }
    kv.update({k.replace("ARCH", arch): v for k, v in override.items()})
    return [(k, t, v) for k, (t, v) in kv.items()]


def _nested_u32_array(rows: list[list[int]]) -> bytes:
    out = struct.pack("<IQ", 9, len(rows))      # array of arrays
    for row in rows:
        out += struct.pack("<IQ", 4, len(row)) + struct.pack(f"<{len(row)}I", *row)
    return out


@pytest.mark.parametrize("key,value,expect", [
    ("ARCH.attention.head_count", (9, _nested_u32_array([[4], [4]])), "head_count"),
    ("ARCH.attention.head_count", (4, struct.pack("<I", 0)), "head_count"),
    ("ARCH.attention.head_count_kv", (4, struct.pack("<I", 0)), "head_count_kv"),
    ("ARCH.attention.head_count_kv", (4, struct.pack("<I", 3)), "not a multiple"),
    ("ARCH.attention.layer_norm_rms_epsilon", (6, struct.pack("<f", math.nan)), "layer_norm_rms_epsilon"),
    ("ARCH.rope.freq_base", (8, _gguf_string("fast")), "freq_base"),
    ("ARCH.context_length", (10, struct.pack("<Q", 2 ** 62)), "context_length"),
    ("general.architecture", (9, struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)), "architecture"),
])
def test_gguf_shape_metadata_is_checked(tmp_path, capsys, key, value, expect):
    path = metadata_only_gguf(tmp_path / "bad.gguf", _shape_kv(**{key: value}))
    line = _one_error_line(capsys, ["convert", str(path), str(tmp_path / "out")])
    assert expect in line
    assert not (tmp_path / "out").exists()


def test_gguf_metadata_arrays_nested_deeply_are_refused(tmp_path):
    from cpullm.loading.gguf_file import open_gguf

    value = b""
    for _ in range(200):                          # 200 arrays, each holding the next
        value += struct.pack("<IQ", 9, 1)
    value += struct.pack("<IQ", 4, 1) + struct.pack("<I", 1)
    path = metadata_only_gguf(tmp_path / "deep.gguf", [("x.deep", 9, value)])
    with pytest.raises(errors.ConversionError, match="nested"):
        open_gguf(path)


def test_gguf_tensor_whose_element_count_wraps_int64_is_refused(tmp_path):
    from cpullm.loading.gguf_file import open_gguf

    # one F32 tensor of shape (2**32, 2**32): 2**64 elements, which int64 arithmetic makes 0
    info = _gguf_string("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 2 ** 32, 2 ** 32)
    info += struct.pack("<IQ", 0, 0)
    kv = _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama")
    raw = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + kv + info
    raw += b"\0" * (-len(raw) % 32)
    path = tmp_path / "wrap.gguf"
    path.write_bytes(raw)
    with pytest.raises(errors.ConversionError, match="does not fit"):
        open_gguf(path)


# ---------------------------------------------------------------------------------------------
# GGUF: tokenizer metadata (needs a complete tiny model so conversion reaches the tokenizer)
# ---------------------------------------------------------------------------------------------

def _tiny_gguf_with(path: Path, overrides: dict, monkeypatch) -> Path:
    """The test suite's tiny llama GGUF with metadata entries replaced (value, GGUFValueType)."""
    gguf = pytest.importorskip("gguf")
    import test_convert

    class Writer(gguf.GGUFWriter):
        def write_kv_data_to_file(self):
            for key, (value, vtype, sub) in overrides.items():
                self.kv_data[0][key] = gguf.GGUFValue(value=value, type=vtype, sub_type=sub)
            super().write_kv_data_to_file()

    monkeypatch.setattr(test_convert.gguf, "GGUFWriter", Writer)
    test_convert.write_tiny_gguf(path, "llama")
    return path


def test_convert_refuses_unknown_tokenizer_type_and_non_string_template(tmp_path, capsys, monkeypatch):
    gguf = pytest.importorskip("gguf")
    T = gguf.GGUFValueType
    cases = {
        "number-model": {"tokenizer.ggml.model": (7, T.UINT32, None)},
        "list-template": {"tokenizer.chat_template": (["a", "b"], T.ARRAY, T.STRING)},
        "numeric-tokens": {"tokenizer.ggml.tokens": (list(range(300)), T.ARRAY, T.UINT32)},
        "list-bos": {"tokenizer.ggml.bos_token_id": ([1, 2], T.ARRAY, T.UINT32)},
    }
    for name, overrides in cases.items():
        path = _tiny_gguf_with(tmp_path / f"{name}.gguf", overrides, monkeypatch)
        line = _one_error_line(capsys, ["convert", str(path), str(tmp_path / f"out-{name}")])
        assert "tokenizer" in line, (name, line)
        assert not (tmp_path / f"out-{name}").exists()


def test_convert_never_writes_a_config_with_nan_eps(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    from cpullm.convert import convert_gguf

    nan_eps = {"llama.attention.layer_norm_rms_epsilon": (math.nan, gguf.GGUFValueType.FLOAT32, None)}
    path = _tiny_gguf_with(tmp_path / "nan.gguf", nan_eps, monkeypatch)
    with pytest.raises(errors.ConversionError, match="epsilon"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,expect", [
    ({"num_hidden_layers": 1e9}, "num_hidden_layers"),
    ({"num_hidden_layers": 2 ** 40}, "num_hidden_layers"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": 66}, "hidden_size"),                       # not a multiple of 4 heads
    ({"rope_theta": "fast"}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"architectures": 5}, "architectures"),
    ({"text_config": [1, 2]}, "text_config"),
    ({"max_position_embeddings": [64]}, "max_position_embeddings"),
])
def test_config_values_are_checked_before_use(tmp_path, good_dir, capsys, change, expect):
    d = _copy(good_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.ConfigError, match=expect):
        read_config(d)
    line = _one_error_line(capsys, ["run", str(d), "-p", "hi", "--no-cache"])
    assert expect in line


def test_config_with_nan_eps_is_refused(tmp_path, good_dir, capsys):
    d = _copy(good_dir, tmp_path / "m")
    text = (d / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN')
    assert "NaN" in text
    (d / "config.json").write_text(text)
    _one_error_line(capsys, ["run", str(d), "-p", "hi", "--no-cache"])


def test_config_nested_too_deeply_is_a_config_error(tmp_path, good_dir, capsys):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").write_text("[" * 100000 + "]" * 100000)
    line = _one_error_line(capsys, ["run", str(d), "-p", "hi", "--no-cache"])
    assert "nested" in line


def test_config_that_is_a_fifo_does_not_hang(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    outcome = _bounded_call(lambda: read_config(d), seconds=10)
    assert isinstance(outcome, errors.ConfigError), outcome


# ---------------------------------------------------------------------------------------------
# safetensors headers and indexes
# ---------------------------------------------------------------------------------------------

def _write_safetensors(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_shape_whose_size_wraps_int64_is_refused_at_header_validation(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    _write_safetensors(d / "model.safetensors",
                       {"w": {"dtype": "F32", "shape": [2 ** 32, 2 ** 32], "data_offsets": [0, 0]}})
    with pytest.raises(errors.CheckpointError, match="invalid shape"):
        TensorStore(d)


@pytest.mark.parametrize("shard", ["../../etc/passwd", "/etc/passwd", "link.safetensors"])
def test_index_shards_outside_the_model_directory_are_refused(tmp_path, good_dir, capsys, shard):
    d = _copy(good_dir, tmp_path / "m")
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"TOPSECRETDATA-never-print-me" * 4)
    (d / "link.safetensors").symlink_to(secret)
    if shard == "../../etc/passwd":
        shard = os.path.relpath(secret, d)
    elif shard == "/etc/passwd":
        shard = str(secret)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(errors.CheckpointError, match="outside the model directory") as info:
        TensorStore(d)
    assert "TOPSECRET" not in str(info.value) and str(struct.unpack("<Q", b"TOPSECRE")[0]) not in str(info.value)
    line = _one_error_line(capsys, ["run", str(d), "-p", "hi", "--no-cache"])
    assert "TOPSECRET" not in line


def test_glob_symlink_out_of_the_model_directory_is_refused(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m")
    outside = tmp_path / "elsewhere.safetensors"
    (d / "model.safetensors").rename(outside)
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(errors.CheckpointError, match="outside the model directory"):
        TensorStore(d)


def test_hugging_face_cache_snapshot_links_into_its_blobs_are_accepted(tmp_path, good_dir):
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in good_dir.iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"sha-{f.name}")
    assert "model.embed_tokens.weight" in TensorStore(snap)


@pytest.mark.parametrize("index_text", [
    '{"weight_map": ["model.safetensors"]}',
    '{"weight_map": {"a": 5}}',
    '{"weight_map": {"a": ["x.safetensors"]}}',
    '{"weight_map": {"a": ' + "[" * 50000 + "]" * 50000 + "}}",
], ids=["list", "number", "unhashable", "nested"])
def test_malformed_index_is_a_checkpoint_error(tmp_path, good_dir, capsys, index_text):
    d = _copy(good_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(index_text)
    with pytest.raises(errors.CheckpointError):
        TensorStore(d)
    _one_error_line(capsys, ["run", str(d), "-p", "hi", "--no-cache"])


# ---------------------------------------------------------------------------------------------
# the execution cache
# ---------------------------------------------------------------------------------------------

def _bounded_call(fn, seconds: float):
    """fn()'s result or exception, or TimeoutError if it is still running after ``seconds``."""
    box = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["out"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return box.get("out", TimeoutError(f"still running after {seconds} s"))


@pytest.fixture
def cached_model(tmp_path, good_dir):
    """A model directory and a private cache root holding one valid entry for it."""
    import cpullm

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    model = cpullm.load(good_dir, cache_dir=root)
    entry = next((root / "exec").iterdir())
    return good_dir, root, entry, model


def test_fifo_manifest_does_not_hang_a_load(cached_model):
    import cpullm

    model_dir, root, entry, _ = cached_model
    (entry / "manifest.json").unlink()
    os.mkfifo(entry / "manifest.json")
    outcome = _bounded_call(lambda: cpullm.load(model_dir, cache_dir=root), seconds=120)
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.cache_status.startswith("MISS")


def test_cache_array_that_is_a_symlink_is_not_mapped(cached_model, tmp_path):
    from cpullm.compile.cache_format import read_entry

    _, _, entry, _ = cached_model
    moved = tmp_path / "wq-elsewhere.bin"
    (entry / "wq.bin").rename(moved)
    (entry / "wq.bin").symlink_to(moved)
    with pytest.raises(errors.CacheError, match="symbolic link"):
        read_entry(entry)


def test_forged_manifest_with_an_overflowing_shape_is_refused(cached_model):
    """A manifest recomputed around a shape whose element count wraps int64 to 0 (so an empty
    file would pass a wrapped size check) is refused before anything is mapped or allocated."""
    from cpullm.compile import cache_format

    _, _, entry, _ = cached_model
    m = json.loads((entry / "manifest.json").read_text())
    m.pop("manifest_sha")
    m["arrays"]["wf"]["shape"] = [2 ** 32, 2 ** 32]
    m["arrays"]["wf"]["checksum"] = cache_format.checksum(np.zeros(0, np.float32))
    m["manifest_sha"] = cache_format.json_sha(m)
    (entry / "manifest.json").write_text(json.dumps(m))
    (entry / "wf.bin").write_bytes(b"")
    with pytest.raises(errors.CacheError, match="malformed"):
        cache_format.read_entry(entry)


def test_cache_root_writable_by_others_is_ignored_with_a_notice(cached_model, capfd, monkeypatch):
    import cpullm

    model_dir, root, entry, _ = cached_model
    os.chmod(root, 0o777)
    monkeypatch.setenv("CPULLM_QUIET", "0")
    model = cpullm.load(model_dir, cache_dir=root)
    assert model.cache_status.startswith("OFF") and "writable by other users" in model.cache_status
    err = capfd.readouterr().err
    assert "ignoring the execution cache" in err and "writable by other users" in err
    os.chmod(root, 0o700)
    assert cpullm.load(model_dir, cache_dir=root).cache_status == "HIT"


# ---------------------------------------------------------------------------------------------
# cpullm models and progress output
# ---------------------------------------------------------------------------------------------

def test_models_lists_a_broken_folder_with_its_reason(tmp_path, good_dir, capsys, monkeypatch):
    store_root = tmp_path / "store"
    store_root.mkdir()
    _copy(good_dir, store_root / "good")
    bad = _copy(good_dir, store_root / "bad-config")
    (bad / "config.json").write_text('{"text_config": "x", "model_type": 5}')
    bad_header = _copy(good_dir, store_root / "bad-header")
    _write_safetensors(bad_header / "model.safetensors", {"w": {"dtype": "F32", "shape": 5, "data_offsets": [0, 0]}})
    listed = _copy(good_dir, store_root / "fifo-config")
    (listed / "config.json").unlink()
    os.mkfifo(listed / "config.json")
    monkeypatch.setenv("CPULLM_MODELS_DIR", str(store_root))
    monkeypatch.setenv("CPULLM_CACHE_DIR", str(tmp_path / "no-cache"))
    outcome = _bounded_call(lambda: main(["models", "--json"]), seconds=30)
    assert outcome == 0, outcome
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert "broken" not in models["good"] and models["good"]["params"] > 0
    assert "invalid header entry" in models["bad-header"]["broken"]
    assert "FIFO" in models["fifo-config"]["broken"]
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "(broken)" in table and "good" in table


def test_progress_has_no_carriage_returns_off_a_terminal_and_errors_start_a_line(tmp_path):
    path = metadata_only_gguf(tmp_path / "bad.gguf", _shape_kv(**{
        "ARCH.attention.head_count_kv": (4, struct.pack("<I", 0))}))
    proc = _run_cli_bounded(["convert", str(path), str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 2
    assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith("cpullm: error:"), lines


def test_progress_bar_line_is_ended_before_an_error():
    import io

    from cpullm.store import text_progress

    buf = io.StringIO()
    with pytest.raises(RuntimeError):
        with text_progress("convert", stream=buf, tty=True) as bar:
            bar("reading", 0.1)
            raise RuntimeError("boom")
    assert buf.getvalue().startswith("\rcpullm: convert: [") and buf.getvalue().endswith("\n")
