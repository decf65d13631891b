"""Fuzz the readers of untrusted model files with mutated real inputs.

Seeds: a tiny GGUF written with the ``gguf`` package's writer, and a tiny safetensors checkpoint
(config.json + model.safetensors + model.safetensors.index.json). Each case mutates one seed
(bit flips, truncation, a huge count written over the header, a JSON field replaced by a value of
another type or an absurd size) and feeds it to the GGUF reader and converter, the safetensors
reader, or the config parser and weight map. Every case must either load or raise a
cpullm.errors error whose message is one line, within a per-case time bound, inside a child
process whose address space is capped, and without writing outside its own temporary directory
(an audit hook in the child records every write-mode open, rename and removal).

The mutations are seeded (``CPULLM_FUZZ_SEED``, default 1), so a failing case is reproducible
from its id and the seed.
"""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {"gguf": 110, "safetensors": 95, "config": 95}   # 300 cases in all
SEED = int(os.environ.get("CPULLM_FUZZ_SEED", "1"))   # another seed explores other mutations
CASE_SECONDS = 20               # per case; a tiny model converts or loads in well under a second
CHILD_SECONDS = 900             # all cases of one kind
MEMORY_LIMIT = 3 << 30          # address space of the child: imports take ~1.5 GB of it, the cases little

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5,
            max_position_embeddings=64, tie_word_embeddings=True, rope_theta=10000.0,
            rope_scaling=None, bos_token_id=1, eos_token_id=[2, 3], architectures=["LlamaForCausalLM"])

# Values a replaced JSON field takes: wrong types, zero, negative, huge, non-finite spellings, nesting.
ODD_VALUES = [0, -1, 1, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 64 + 5, 1e9, 1e308, -1e-300, 0.5, "NaN", "x" * 300,
              "", None, True, False, [], {}, [[[[1]]]], {"a": {"b": {"c": 1}}}, [2 ** 32, 2 ** 32],
              [1] * 9, "../../etc/passwd", "/etc/passwd", "F32", "BF16", "I64"]
HUGE_INTS = [0, 1, 2 ** 31 - 1, 2 ** 32, 2 ** 40, 2 ** 62, 2 ** 64 - 1, 0xFFFFFFFF]


# ---------------------------------------------------------------------------------------------
# seeds
# ---------------------------------------------------------------------------------------------

def make_gguf_seed(path: Path) -> tuple[bytes, int]:
    """(bytes of a tiny llama GGUF, length of its header: where tensor data starts)."""
    import test_convert

    from cpullm.loading.gguf_file import open_gguf

    test_convert.write_tiny_gguf(path, "llama", layers=2)
    reader = open_gguf(path)
    header_end = min(t.data_offset for t in reader.tensors)
    return path.read_bytes(), header_end


def make_checkpoint_seed(out: Path) -> dict[str, bytes]:
    """{file name: bytes} of a tiny llama checkpoint with an index naming its one shard."""
    from cpullm.testing import make_random_checkpoint

    make_random_checkpoint(TINY, out)
    st = (out / "model.safetensors").read_bytes()
    n = int.from_bytes(st[:8], "little")
    names = [k for k in json.loads(st[8:8 + n]) if k != "__metadata__"]
    index = {"metadata": {"total_size": len(st) - 8 - n},
             "weight_map": {k: "model.safetensors" for k in names}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


# ---------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------

def flip_bits(data: bytes, rng: random.Random, end: int) -> tuple[bytes, str]:
    buf = bytearray(data)
    spots = [rng.randrange(max(1, min(end, len(buf)))) for _ in range(rng.randint(1, 8))]
    for i in spots:
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf), f"flip bits at {spots}"


def truncate(data: bytes, rng: random.Random, end: int) -> tuple[bytes, str]:
    cut = rng.randrange(len(data)) if rng.random() < 0.3 else rng.randrange(max(1, min(end, len(data))))
    return data[:cut], f"truncate to {cut}"


def huge_count(data: bytes, rng: random.Random, end: int) -> tuple[bytes, str]:
    buf = bytearray(data)
    at = rng.randrange(max(1, min(end, len(buf)) - 8))
    value = rng.choice(HUGE_INTS)
    width = rng.choice((4, 8))
    buf[at:at + width] = struct.pack("<Q" if width == 8 else "<I", value & ((1 << (8 * width)) - 1))
    return bytes(buf), f"write {value} ({width} bytes) at {at}"


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON document, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:16]):
            yield from _paths(v, prefix + (i,))


def replace_field(doc, rng: random.Random):
    """A copy of the JSON document with one field (at any depth) replaced by an odd value."""
    doc = json.loads(json.dumps(doc))
    paths = [p for p, _ in _paths(doc) if p]
    path = rng.choice(paths)
    value = rng.choice(ODD_VALUES)
    target = doc
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return doc, f"set {'.'.join(map(str, path))} = {json.dumps(value)[:40]}"


def mutate_safetensors_header(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header, what = replace_field(header, rng)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:], "header: " + what


def gguf_case(seed: bytes, header_end: int, rng: random.Random) -> tuple[dict, str]:
    mutate = rng.choice((flip_bits, flip_bits, truncate, huge_count, huge_count))
    data, what = mutate(seed, rng, header_end)
    return {"model.gguf": data}, what


def safetensors_case(seed: dict, rng: random.Random) -> tuple[dict, str]:
    files = dict(seed)
    st = files["model.safetensors"]
    n = int.from_bytes(st[:8], "little")
    kind = rng.randrange(5)
    if kind == 0:
        files["model.safetensors"], what = mutate_safetensors_header(st, rng)
    elif kind == 1:
        files["model.safetensors"], what = flip_bits(st, rng, 8 + n)
    elif kind == 2:
        files["model.safetensors"], what = truncate(st, rng, 8 + n)
    elif kind == 3:
        files["model.safetensors"], what = huge_count(st, rng, 8 + n)
    else:
        index, what = replace_field(json.loads(files["model.safetensors.index.json"]), rng)
        files["model.safetensors.index.json"] = json.dumps(index).encode()
        what = "index: " + what
    return files, what


def config_case(seed: dict, rng: random.Random) -> tuple[dict, str]:
    files = dict(seed)
    config = json.loads(files["config.json"])
    kind = rng.randrange(4)
    if kind < 3:
        for _ in range(kind + 1):
            config, what = replace_field(config, rng)
        files["config.json"] = json.dumps(config).encode()
    else:
        files["config.json"], what = flip_bits(files["config.json"], rng, len(files["config.json"]))
    return files, "config: " + what


def write_cases(kind: str, root: Path, rng: random.Random) -> dict[str, str]:
    """Write every case of ``kind`` into ``root/<id>/``; returns {id: what was mutated}."""
    seeds = root / "seed"
    seeds.mkdir(parents=True)
    if kind == "gguf":
        seed, header_end = make_gguf_seed(seeds / "model.gguf")
        make = lambda: gguf_case(seed, header_end, rng)  # noqa: E731
    else:
        checkpoint = make_checkpoint_seed(seeds / "checkpoint")
        make = (lambda: safetensors_case(checkpoint, rng)) if kind == "safetensors" else (lambda: config_case(checkpoint, rng))  # noqa: E731
    described = {}
    for i in range(CASES[kind]):
        files, what = make()
        case = root / f"{kind}-{i:03d}"
        case.mkdir()
        for name, data in files.items():
            (case / name).write_bytes(data)
        described[case.name] = what
    return described


# ---------------------------------------------------------------------------------------------
# the child process: runs every case under limits and reports one JSON line per case
# ---------------------------------------------------------------------------------------------

def _child(kind: str, root: Path) -> None:
    import resource
    import signal
    import traceback

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import numpy  # noqa: F401  (imported before the audit hook: imports may write bytecode)

    from cpullm.loading import plugins
    from cpullm.convert import convert_gguf
    from cpullm.errors import CpullmError
    from cpullm.loading.family import read_config
    from cpullm.graph.ir import GraphBuilder
    from cpullm.loading.tensors import TensorStore

    registry = plugins.discover()
    import tokenizers  # noqa: F401
    violations = []
    allowed = os.path.realpath(root)

    def outside(path) -> bool:
        if isinstance(path, int) or path is None:
            return False
        real = os.path.realpath(os.fsdecode(path))
        return not (real == allowed or real.startswith(allowed + os.sep)) and "__pycache__" not in real

    def audit(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and outside(path):
                violations.append(f"open {path} {mode}")
        elif event in ("os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree",
                       "os.symlink", "os.truncate", "os.chmod", "os.link"):
            if outside(args[0]) or (event in ("os.rename", "os.replace") and outside(args[1])):
                violations.append(f"{event} {args[:2]}")

    sys.addaudithook(audit)

    class CaseTimeout(BaseException):
        pass

    def alarm(signum, frame):
        raise CaseTimeout()

    signal.signal(signal.SIGALRM, alarm)

    def load(case: Path) -> None:
        config = read_config(case)
        family = registry.family_for(config)
        args = family.args(config)
        store = TensorStore(case)
        weights = family.weight_map(args).resolve(store, args)
        for name in weights.names():
            weights.get(name)
        family.build_graph(args, GraphBuilder())

    for case in sorted(p for p in root.iterdir() if p.name.startswith(kind)):
        print(json.dumps({"start": case.name}), flush=True)
        signal.alarm(CASE_SECONDS)
        try:
            if kind == "gguf":
                convert_gguf(case / "model.gguf", case / "out")
            else:
                load(case)
            result = {"outcome": "ok"}
        except CpullmError as exc:
            result = {"outcome": "error", "message": str(exc)}
        except CaseTimeout:
            result = {"outcome": "timeout"}
        except MemoryError:
            result = {"outcome": "memory"}
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
            result = {"outcome": "crash", "message": "".join(traceback.format_exception(exc))[-3000:]}
        finally:
            signal.alarm(0)
        print(json.dumps({"case": case.name, **result}), flush=True)
    print(json.dumps({"violations": violations}), flush=True)


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(CASES))
def test_mutated_inputs_load_or_fail_with_one_line_errors(kind, tmp_path):
    pytest.importorskip("gguf")
    root = tmp_path / "cases"
    described = write_cases(kind, root, random.Random(f"{SEED}-{kind}"))
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), TMPDIR=str(root), CPULLM_CACHE_DIR=str(root / "exec-cache"),
               CPULLM_MODELS_DIR=str(root / "store"), CPULLM_QUIET="1")
    try:
        proc = subprocess.run([sys.executable, __file__, kind, str(root)], capture_output=True, text=True,
                              timeout=CHILD_SECONDS, cwd=root, env=env)
        stdout = proc.stdout
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        started = [json.loads(x)["start"] for x in stdout.splitlines() if '"start"' in x]
        pytest.fail(f"the child hung; last case started: {started[-1:]} ({described.get(started[-1]) if started else ''})")
    records = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    results = {r["case"]: r for r in records if "case" in r}
    assert len(results) == CASES[kind], f"child ended early (exit {proc.returncode}): {proc.stderr[-3000:]}"
    bad = {c: (described[c], r) for c, r in results.items() if r["outcome"] not in ("ok", "error")}
    assert not bad, f"{len(bad)} cases neither loaded nor failed cleanly: {list(bad.items())[:3]}"
    multiline = {c: (described[c], r["message"]) for c, r in results.items()
                 if r["outcome"] == "error" and ("\n" in r["message"] or len(r["message"]) > 4000)}
    assert not multiline, f"error messages must be one line: {list(multiline.items())[:3]}"
    violations = next(r["violations"] for r in records if "violations" in r)
    assert violations == [], f"wrote outside its temporary directory: {violations[:5]}"
    assert not any(home.iterdir()), f"wrote into HOME: {list(home.iterdir())}"
    outcomes = {r["outcome"] for r in results.values()}
    assert "error" in outcomes, "no mutation was refused: the mutations do not reach the parsers"


if __name__ == "__main__":
    _child(sys.argv[1], Path(sys.argv[2]))
