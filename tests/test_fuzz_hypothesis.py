"""Property-based fuzzing (hypothesis) of the readers of untrusted bytes and requests, each with a
fixed small budget so the whole file runs in well under two minutes: the GGUF header parser, the
safetensors header parser, the prompt-cache reader, the execution-cache reader and the server's
request validator. The property is the same everywhere: the input is accepted, or refused with
one of cpullm's own errors (cpullm.errors) whose message is one line; any other exception fails.

Generation is derandomized (the same examples on every run, so CI is reproducible); the seeded
mutation fuzzers beside it (tests/test_fuzz_inputs.py, tests/test_fuzz_requests.py) explore with
real files and a real server, this one explores structure (field types, nesting, sizes) quickly
in process."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cpullm.errors import CpullmError  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# any JSON value, nested a little (the parsers check types and sizes of every field)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
SIZES = st.sampled_from([0, 1, 2, 3, 7, 8, 64, 2**31 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1])


RUNS: list = []      # one entry per example run, so each test can check its budget was spent


def _refused_cleanly(fn) -> None:
    RUNS.append(1)
    try:
        fn()
    except CpullmError as exc:
        assert "\n" not in str(exc), str(exc)


def _spent(check) -> None:
    """Run a property; it must have tried (nearly) its whole budget of examples."""
    before = len(RUNS)
    check()
    assert len(RUNS) - before >= FUZZ.max_examples // 2, len(RUNS) - before


# ---------------------------------------------------------------------------------------------
# GGUF: a header built from random pieces, and the tiny seed with splices
# ---------------------------------------------------------------------------------------------

def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@st.composite
def gguf_headers(draw) -> bytes:
    version = draw(st.sampled_from([2, 3, 3, 3, 1, 4, 0x03000000]))
    kvs = draw(st.lists(st.tuples(st.text(max_size=30).map(str.encode),
                                  st.integers(0, 13), st.binary(max_size=40)), max_size=5))
    tensors = draw(st.lists(st.tuples(st.text(max_size=20).map(str.encode), st.integers(0, 9),
                                      st.lists(SIZES, max_size=4), st.integers(0, 40), SIZES), max_size=4))
    out = b"GGUF" + struct.pack("<I", version)
    out += struct.pack("<QQ", draw(st.sampled_from([len(tensors), 2**40])), draw(st.sampled_from([len(kvs), 2**40])))
    for key, vtype, raw in kvs:
        out += _gguf_string(key) + struct.pack("<I", vtype) + raw
    for name, n_dims, dims, qtype, offset in tensors:
        out += _gguf_string(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in dims[:n_dims])
        out += struct.pack("<IQ", qtype, offset)
    return out + draw(st.binary(max_size=256))


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory) -> bytes:
    pytest.importorskip("gguf")
    import test_convert
    path = tmp_path_factory.mktemp("seed") / "seed.gguf"
    test_convert.write_tiny_gguf(path, "llama", layers=1)
    return path.read_bytes()


def _read_gguf(path: Path) -> None:
    from cpullm.loading.gguf_file import hyperparameters, open_gguf, read_metadata
    reader = open_gguf(path)
    meta = read_metadata(reader)
    if meta.get("general.architecture") == "llama":
        hyperparameters(meta, reader)
    for t in reader.tensors[:4]:
        t.data


def test_gguf_header_parser_on_random_headers(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "f.gguf"

    @FUZZ
    @given(gguf_headers())
    def check(data):
        path.write_bytes(data)
        _refused_cleanly(lambda: _read_gguf(path))
    _spent(check)


def test_gguf_header_parser_on_spliced_seed(gguf_seed, tmp_path):
    path = tmp_path / "f.gguf"
    head = min(len(gguf_seed), 4096)

    @FUZZ
    @given(st.integers(0, head - 1), st.binary(min_size=1, max_size=16), st.booleans())
    def check(at, patch, cut):
        data = gguf_seed[:at] + patch + (b"" if cut else gguf_seed[at + len(patch):])
        path.write_bytes(data)
        _refused_cleanly(lambda: _read_gguf(path))
    _spent(check)


# ---------------------------------------------------------------------------------------------
# safetensors headers
# ---------------------------------------------------------------------------------------------

@st.composite
def safetensors_files(draw) -> bytes:
    entry = st.fixed_dictionaries({}, optional={
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "Q4", ""]) | JSON,
        "shape": st.lists(SIZES, max_size=4) | JSON,
        "data_offsets": st.lists(SIZES, min_size=0, max_size=3) | JSON})
    header = draw(st.dictionaries(st.text(min_size=1, max_size=12), entry | JSON, max_size=4))
    if draw(st.booleans()):
        header["__metadata__"] = draw(JSON)
    raw = json.dumps(header).encode()
    n = draw(st.sampled_from([len(raw), len(raw) + 1, 0, 2**40, max(0, len(raw) - 1)]))
    return struct.pack("<Q", n) + raw + draw(st.binary(max_size=128))


def test_safetensors_header_parser(tmp_path):
    from cpullm.loading.tensors import _Shard
    path = tmp_path / "model.safetensors"

    @FUZZ
    @given(safetensors_files())
    def check(data):
        path.write_bytes(data)

        def read():
            _Shard(path).close()
        _refused_cleanly(read)
    _spent(check)


# ---------------------------------------------------------------------------------------------
# prompt cache and execution cache readers, on a tiny model
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import cpullm
    from cpullm.testing import make_random_checkpoint
    from tiny_configs import SMOLLM2_LIKE
    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path_factory.mktemp("fz") / "m", seed=1)
    root = tmp_path_factory.mktemp("fz-cache")
    root.chmod(0o700)
    model = cpullm.load(d, cache_dir=root, n_ctx=64)
    return model, root


def test_prompt_cache_reader(tiny, tmp_path):
    from cpullm.run import prompt_cache as pcm
    model, _ = tiny
    path = tmp_path / "p.cache"
    pcm.PromptCache(model, path, load=False)
    m = model.use_prompt_cache(path)
    list(m.generate_ids(list(range(30, 50)), 1, ignore_eos=True))
    m.save_prompt_cache()
    model.detach_prompt_cache()
    seed = path.read_bytes()
    _, _, _, hlen = pcm._PREFIX.unpack_from(seed)
    header = json.loads(seed[pcm._PREFIX.size: pcm._PREFIX.size + hlen])
    data = seed[pcm._align(pcm._PREFIX.size + hlen):]

    @FUZZ
    @given(st.sampled_from(["tokens", "kv_len", "at", "regions", "data_bytes", "identity", "region"]), JSON,
           st.booleans())
    def check(field, value, reseal):
        h = json.loads(json.dumps(header))
        if field == "region":
            h["regions"][0][list(h["regions"][0])[hash(json.dumps(value)) % len(h["regions"][0])]] = value
        else:
            h[field] = value
        if reseal:
            h["header_sha"] = pcm._header_sha(h)
        hb = json.dumps(h).encode()
        out = pcm._PREFIX.pack(pcm.MAGIC, pcm.VERSION, 0, len(hb)) + hb
        path.write_bytes(out + b"\0" * (pcm._align(len(out)) - len(out)) + data)
        _refused_cleanly(lambda: pcm.PromptCache(model, path))
    _spent(check)


def test_execution_cache_reader(tiny):
    from cpullm.compile import cache_format
    model, root = tiny
    entry = next((root / "exec").iterdir())
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest.pop("manifest_sha")
    I = np.fromfile(entry / "I.bin", dtype=manifest["arrays"]["I"]["dtype"]).reshape(manifest["arrays"]["I"]["shape"])
    meta_keys = sorted(manifest["program_meta"])

    @FUZZ
    @given(st.sampled_from(meta_keys + ["arrays", "key", "format_version", "I"]), JSON,
           st.integers(0, I.size - 1), st.sampled_from([-1, 0, 2**31, 2**40, -2**40, 7]))
    def check(field, value, cell, number):
        m = json.loads(json.dumps(manifest))
        forged = I.copy()
        if field == "I":
            forged.reshape(-1)[cell] = number
        elif field in ("arrays", "key", "format_version"):
            m[field] = value
        else:
            m["program_meta"][field] = value
        if isinstance(m.get("arrays"), dict) and isinstance(m["arrays"].get("I"), dict):
            m["arrays"]["I"]["checksum"] = cache_format.checksum(forged)
        m["manifest_sha"] = cache_format.json_sha(m)
        (entry / "manifest.json").write_text(json.dumps(m))
        forged.tofile(entry / "I.bin")
        _refused_cleanly(lambda: cache_format.read_entry(entry))
    try:
        _spent(check)
    finally:
        I.tofile(entry / "I.bin")
        manifest["manifest_sha"] = cache_format.json_sha(manifest)
        (entry / "manifest.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------------------------
# the server's request validator
# ---------------------------------------------------------------------------------------------

REQUEST_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                "top_k", "min_p", "repetition_penalty", "seed", "stop", "stream", "stream_options", "n",
                "logprobs", "logit_bias", "response_format", "tools", "chat_template_kwargs", "cache_salt",
                "echo", "suffix", "presence_penalty"]


def test_request_validator(tiny):
    from cpullm.serve.openai import Api
    model, _ = tiny
    api = Api(model, "m", engine=None)

    @FUZZ
    @given(st.dictionaries(st.sampled_from(REQUEST_KEYS), JSON, max_size=6), st.booleans())
    def check(body, chat):
        body.setdefault("messages" if chat else "prompt", "hello" if not chat else [{"role": "user", "content": "hi"}])
        prepare = api.prepare_chat if chat else api.prepare_completion
        _refused_cleanly(lambda: prepare(body))
    _spent(check)
