"""Checkpoint -> llama.cpp's own convert_hf_to_gguf.py -> BF16 / F32 GGUF (``--llama-convert``, and
every architecture cpullm's writer has no table for), and the GGUF files each llama.cpp runtime
runs, made once per checkpoint and kept (``ensure_ggufs``)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .gguf import _text_config, checkpoint_identity, llama_quantize, write_f32_gguf

GGUF_PY = str(Path(__file__).resolve().with_name("gguf.py"))
"""gguf.py, loaded by path in the converter's process for its vocabulary fallback."""

CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
"""What of llama-cpp-python's source distribution (under vendor/llama.cpp/) the converter needs."""

_CONVERT_DRIVER = r'''
import importlib.util, runpy, sys
src, gguf_py = sys.argv[1:3]
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion

real_get_model_class = conversion.get_model_class


def vocab_from_tokenizer_json(self, why):
    spec = importlib.util.spec_from_file_location("cpullm_compare_vocab", gguf_py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    print("compare: llama.cpp's converter does not take this tokenizer (%s: %s); its vocabulary is "
          "written from tokenizer.json instead" % (type(why).__name__, str(why).splitlines()[0][:160]),
          file=sys.stderr, flush=True)
    import json
    config = json.loads((self.dir_model / "config.json").read_text())
    fields, special = mod._vocab_fields(self.dir_model, config, mod._text_config(config))
    w = self.gguf_writer
    w.add_tokenizer_model(fields["tokenizer_model"])
    w.add_tokenizer_pre("default")
    w.add_token_list(fields["token_list"])
    w.add_token_types(fields["token_types"])
    if "token_scores" in fields:
        w.add_token_scores(fields["token_scores"])
    special.add_to_gguf(w, quiet=True)


def get_model_class(*args, **kwargs):
    cls = real_get_model_class(*args, **kwargs)
    if not hasattr(cls, "set_vocab"):
        return cls

    def set_vocab(self):
        try:
            cls.set_vocab(self)
        except (NotImplementedError, FileNotFoundError, ModuleNotFoundError) as why:
            vocab_from_tokenizer_json(self, why)

    # --no-mtp where the class has it: no runtime here runs the multi-token-prediction layer
    extra = {"no_mtp": True} if getattr(cls, "supports_mtp_export", False) else {}
    return type(cls.__name__, (cls,), {"model_arch": cls.model_arch, "set_vocab": set_vocab, **extra})


conversion.get_model_class = get_model_class
runpy.run_path(sys.argv[0], run_name="__main__")
'''
"""Runs llama.cpp's converter as it is, with one fallback: when its vocabulary step rejects the
checkpoint's tokenizer (a BPE tokenizer whose pre-tokenizer hash it does not list, or no
SentencePiece ``tokenizer.model``), the vocabulary is written from tokenizer.json by
``_vocab_fields``, as cpullm's own writer does. benchmarks/synth.py's tokenizers always take the
fallback: the hash is of the token ids of a fixed text, which no synthetic vocabulary reproduces;
the benchmark feeds token ids, so llama.cpp never tokenizes with it. And the converter's
``--no-mtp`` where the model has a multi-token-prediction layer (Qwen3.5): neither runtime runs it,
and the report counts every tensor of the GGUF but the embedding as read per decode token."""


def writer_has_table(model_dir: Path) -> bool:
    """Whether cpullm's GGUF writer knows the checkpoint's architecture (an installed plugin declares
    its GGUF table, for a uniform decoder); llama.cpp's converter makes the GGUF of the others."""
    from cpullm.convert.gguf_writer import gguf_arch_for_model_type
    from cpullm.errors import ConversionError

    cfg = _text_config(json.loads((Path(model_dir) / "config.json").read_text()))
    try:
        arch = gguf_arch_for_model_type(cfg.get("model_type"))
    except ConversionError:
        return False
    # gguf._header_fields writes the header of a uniform decoder: hybrid architectures (per-layer
    # tensors, e.g. Qwen3.5's qwen35 with its ssm.* keys) are left to llama.cpp's converter
    return arch.layer_tensors is None


def llama_cpp_converter(work_dir: Path, say=print) -> Path:
    """The directory holding llama.cpp's ``convert_hf_to_gguf.py`` (with its ``conversion`` package
    and ``gguf-py``) of the installed llama-cpp-python's version: unpacked once from that version's
    source distribution (``pip download``, ~77 MB, deleted after) into ``work_dir``, reused after."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("compare: llama.cpp's converter comes with llama-cpp-python's version; "
                         "install it (pip install 'cpullm[bench]')") from None
    version = llama_cpp.__version__
    dest = work_dir / f"llama.cpp-convert-{version}"
    if (dest / CONVERTER_PARTS[0]).is_file():
        return dest
    import shutil
    import tarfile

    work_dir.mkdir(parents=True, exist_ok=True)
    dl = Path(tempfile.mkdtemp(prefix="sdist-", dir=work_dir))
    try:
        say(f"fetching llama.cpp's converter: pip download llama-cpp-python=={version} (source distribution)")
        cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
               "--no-binary", ":all:", "--quiet", "-d", str(dl)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(dl.glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            last = (proc.stderr.strip().splitlines() or ["no archive downloaded"])[-1]
            raise SystemExit(f"compare: could not fetch llama.cpp's converter (pip download "
                             f"llama-cpp-python=={version} --no-binary :all:: {last}); "
                             "give pip access to PyPI, or pass a GGUF of the checkpoint with --gguf FILE")
        tmp = dl / "unpacked"
        with tarfile.open(sdists[0]) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 3)          # llama_cpp_python-X/vendor/llama.cpp/<rest>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and \
                        any(parts[3] == p or parts[3].startswith(p) for p in CONVERTER_PARTS):
                    m.name = parts[3]
                    members.append(m)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}   # Python >= 3.10.12
            tar.extractall(tmp, members=members, **safe)
        if not (tmp / CONVERTER_PARTS[0]).is_file():
            raise SystemExit(f"compare: llama-cpp-python {version}'s source distribution has no "
                             "vendor/llama.cpp/convert_hf_to_gguf.py; pass a GGUF with --gguf FILE")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return dest


def _converter_outtype(model_dir: Path) -> str:
    """"bf16" when every matrix of the checkpoint is bf16 (exact), else "f32" (exact for f32 and
    f16 checkpoints; vectors stay F32 either way)."""
    from cpullm.loading.tensors import TensorStore

    store = TensorStore(model_dir)
    dtypes = {store.dtype(n) for n in store.names() if len(store.shape(n)) >= 2}
    return "bf16" if dtypes == {"BF16"} else "f32"


def llama_convert_gguf(model_dir, out_path, work_dir: Path, say=print) -> Path:
    """The checkpoint as a BF16 (or F32) GGUF made by llama.cpp's own ``convert_hf_to_gguf.py``
    of the installed libllama's version, run in a subprocess with its own gguf-py (see
    ``_CONVERT_DRIVER`` for its one fallback). Multimodal checkpoints (Gemma 3 4B-IT, Qwen3.5)
    give their text model: the converter drops the vision tower unless asked for ``--mmproj``."""
    model_dir, out_path = Path(model_dir), Path(out_path)
    src = llama_cpp_converter(Path(work_dir), say)
    outtype = _converter_outtype(model_dir)
    say(f"converting the checkpoint with llama.cpp's convert_hf_to_gguf.py ({outtype})")
    cmd = [sys.executable, "-c", _CONVERT_DRIVER, str(src), GGUF_PY, str(model_dir), "--outfile", str(out_path), "--outtype", outtype]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(src / "gguf-py")]), NO_LOCAL_GGUF="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stderr.splitlines():
        if line.startswith("compare: "):
            say(line[len("compare: "):])
    if proc.returncode != 0 or not out_path.is_file():
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        out_path.unlink(missing_ok=True)
        missing = re.search(r"No module named '([\w.]+)'", proc.stderr)
        fix = (f"install {missing.group(1).partition('.')[0]} (the converter needs torch and transformers)"
               if missing else "pass a GGUF of the checkpoint with --gguf FILE")
        raise SystemExit(f"compare: llama.cpp's convert_hf_to_gguf.py failed on {model_dir.name}: "
                         f"{last.strip()[:300]}; {fix}")
    return out_path




def ensure_ggufs(model_dir: Path, work_dir: Path, threads: int, ftypes, say=print,
                 llama_convert: bool | None = None) -> dict:
    """{ftype: path} of llama.cpp's quantization of the checkpoint to each of ``ftypes`` (Q8_0,
    Q4_K_M, Q4_0), kept in ``work_dir`` under the checkpoint's identity and reused. They are made
    from one full-precision GGUF, written once and deleted after: by cpullm's writer (F32) when an
    installed plugin has the architecture's GGUF table, else (or with ``llama_convert=True``) by
    llama.cpp's own convert_hf_to_gguf.py (BF16 or F32, ``llama_convert_gguf``)."""
    model_dir = Path(model_dir)
    if llama_convert is None:
        llama_convert = not writer_has_table(model_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{model_dir.name}-{checkpoint_identity(model_dir)}" + ("-hfconv" if llama_convert else "")
    out = {ft: work_dir / f"{stem}.{ft}.gguf" for ft in ftypes}
    for ft, path in out.items():
        if path.is_file():
            say(f"using the {ft} GGUF {path}")
    missing = [ft for ft, path in out.items() if not path.is_file()]
    if not missing:
        return out
    full = work_dir / f"{stem}.full.gguf.partial"
    try:
        if llama_convert:
            llama_convert_gguf(model_dir, full, work_dir, say)
        else:
            say(f"writing the checkpoint as an F32 GGUF ({full.name})")
            write_f32_gguf(model_dir, full)
        for ft in missing:
            say(f"quantizing it to {ft} with llama_cpp.llama_model_quantize")
            llama_quantize(full, out[ft], threads, ft)
    finally:
        full.unlink(missing_ok=True)
    return out


def gguf_source(model_dir: Path, llama_convert: bool | None = None) -> str:
    """Which converter made llama.cpp's files of the checkpoint (ensure_ggufs' choice), for the report."""
    if llama_convert is None:
        llama_convert = not writer_has_table(model_dir)
    if not llama_convert:
        return "cpullm's GGUF writer (F32), quantized by llama_model_quantize"
    import llama_cpp

    return (f"llama.cpp's convert_hf_to_gguf.py of llama-cpp-python {llama_cpp.__version__}, quantized by "
            "llama_model_quantize")


def ensure_q8_gguf(model_dir: Path, work_dir: Path, threads: int, say=print,
                   llama_convert: bool | None = None) -> Path:
    """llama.cpp's Q8_0 of the checkpoint (benchmarks/batched.py's llama.cpp file)."""
    return ensure_ggufs(model_dir, work_dir, threads, ["Q8_0"], say, llama_convert)["Q8_0"]
