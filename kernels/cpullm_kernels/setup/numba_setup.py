"""Process-wide numba / LLVM / thread-pool settings, applied before the first kernel compiles.

Import this module first (``cpullm_kernels/__init__`` does). Ideally it is imported before numpy
and numba too (``import cpullm`` can import it first thing): two of the settings are environment
variables that their libraries read only when they load.

What it sets, and why (numbers from benchmarks/ab/kernels_q8.py):

1. LLVM ``--unroll-full-max-count=4``. Without it LLVM fully unrolls every ``for j in range(32)``
   block loop *before* the loop vectorizer sees it and emits 32 scalar ``imul``: block-quantized
   loops run 3-5x slower (a plain-numba q8 matvec: 2.2 against 9.4 GB/s on 1 thread). The
   option is global to the process and applies to every later compile, including other modules'.

2. CPU model. numba tunes for ``llvm.get_host_cpu_name()`` (``znver3`` here). On AVX-512 Intel
   hosts that tuning carries LLVM's "prefer 256-bit vectors" flag, which halved the integer kernels
   there; ``NUMBA_CPU_NAME=host`` fixed it there, but an unknown CPU name makes
   LLVM print "'host' is not a recognized processor" on every compile and drops the scheduling
   model. The equivalent used here keeps the real CPU name and appends ``-prefer-256-bit`` to the
   host's feature string, on AVX-512 hosts only (on AVX2-only hosts such as the AMD EPYC of CI it
   changes nothing: there are no wider vectors, and the real CPU name is measurably better than
   ``host``: 9.4 vs 7.9 GB/s for the plain-numba q8 matvec). User-set ``NUMBA_CPU_NAME`` /
   ``NUMBA_CPU_FEATURES`` always win. Cached kernels are keyed by CPU name and features (numba's
   cache index), so a cache built on one machine kind is never loaded on another.

3. ``GOMP_SPINCOUNT`` (default here 10000, unless set). After a parallel region numba's OpenMP
   workers busy-wait for new work before sleeping; libgomp's default is 300000 spins. With 10000
   the launch of a tiny kernel after a serial gap stays ~1.5-2 us for gaps up to ~100 us (decode's gaps between kernels are shorter)
   and the workers sleep after ~150-200 us; with 1000 a launch after a 50 us gap costs 8 us; with
   300000 they spin for milliseconds and fight OpenBLAS / the prefill threads for the 2 cores
   (measured: 2.7x slower prefill). A woken worker costs ~15-25 us.
   ``OMP_WAIT_POLICY=passive`` would cost ~70 us per launch: it is not set. No spin setting helps
   when another process holds a core: a 2-thread barrier then stalls for scheduler time slices
   (decode measured 100x slower); use threads=1 on a busy machine.

4. ``OPENBLAS_THREAD_TIMEOUT`` (default here 4, unless set): OpenBLAS's idle threads spin for
   2^N cycles (default 2^28, ~0.1 s) after each call; at 4 they go to sleep at once. Effective
   only if this module is imported before numpy loads OpenBLAS. (kquant_gemm's dequantize + sgemm
   path does not depend on it: it runs OpenBLAS single-threaded on its own Python threads, see
   :class:`blas_threads`.)

5. Threading layer priority omp > tbb > workqueue (workqueue: ~130 us per launch).

6. ``NUMBA_NUM_THREADS`` (the pool size, unless set and only if numba is not imported yet) =
   physical cores: SMT siblings add nothing to bandwidth-bound decode.

:func:`configure` sets the number of threads kernels use (numba's and OpenBLAS's) and returns it;
:func:`blas_threads` limits OpenBLAS for a block (ctypes on the loaded library, no dependency).
"""
from __future__ import annotations

import os
import sys
import warnings


def physical_cores() -> int:
    """Number of physical cores available to this process (SMT siblings counted once)."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list"
        try:
            with open(path) as fh:
                cores.add(fh.read().strip())
        except OSError:
            try:
                with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as fh:
                    cores.add(fh.read().strip())
            except OSError:
                cores.add(str(cpu))
    return max(1, len(cores))


# ---- environment read by libraries when they load (so: before numba / numpy import) ----------
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")  # read by numba's config reloads
if "numba" not in sys.modules:
    os.environ.setdefault("NUMBA_NUM_THREADS", str(physical_cores()))

import llvmlite.binding as _llb  # noqa: E402

_llb.set_option("", "--unroll-full-max-count=4")
_llb.initialize_native_asmparser()   # numba does not: without it a kernel's inline assembly aborts LLVM

import numba  # noqa: E402
from numba.core import config as _config  # noqa: E402

from . import numba_cache_lock  # noqa: E402

numba_cache_lock.install()     # two processes compile into one cache at a cold start (warmup.py)



def _host_features() -> str:
    return _llb.get_host_cpu_features().flatten()


def _tune_cpu() -> None:
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return
    feats = _host_features()
    if "+avx512f" not in feats.split(","):
        return
    # Through the environment: numba's compiler reloads its config from NUMBA_* variables.
    os.environ["NUMBA_CPU_FEATURES"] = feats + ",-prefer-256-bit"
    _config.reload_config()
    from numba.core.registry import cpu_target
    if "_toplevel_target_context" in vars(cpu_target):
        warnings.warn("cpullm_kernels.setup.numba_setup was imported after numba compiled something: "
                      "the AVX-512 vector-width tuning does not apply in this process",
                      RuntimeWarning, stacklevel=2)


_tune_cpu()

HOST_FEATURES = frozenset(f[1:] for f in (os.environ.get("NUMBA_CPU_FEATURES") or _host_features()).split(",")
                          if f.startswith("+"))
"""ISA extensions the kernels are compiled for, as LLVM names them (``avx2``, ``fma``, ``f16c``,
``avx512vnni`` ...): this CPU's, or those of ``NUMBA_CPU_FEATURES`` when it is set (numba then
compiles for that feature set, and the kernels that pick instructions must agree with it)."""

HOST_IS_X86 = _llb.get_process_triple().split("-")[0] in ("x86_64", "i386", "i686")
"""True on x86 hosts (the feature names above are x86 ISA extensions there)."""

RESTRICTED_TARGETS = {"avx2": "haswell", "avxvnni": "alderlake"}
"""Lesser x86 targets this host can compile for and run (:func:`restricted_target_env`), with the
LLVM CPU name each is tuned for: AVX2 (Zen 2/3, Haswell to Comet Lake) and AVX2 + AVX-VNNI
(Intel's client CPUs from Alder Lake on, which have no AVX-512)."""


def restricted_target_env(isa: str) -> dict:
    """``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` for a child process that compiles every kernel
    for the lesser target ``isa`` (a key of RESTRICTED_TARGETS): this host's features with every
    AVX-512, AMX and AVX10 extension off, and AVX-VNNI off unless ``isa`` is "avxvnni". The
    kernels then pick their instructions as on such a CPU (HOST_FEATURES follows the variable).
    Raises ValueError when this host cannot run that target."""
    if isa not in RESTRICTED_TARGETS:
        raise ValueError(f"unknown target {isa!r}: one of {', '.join(RESTRICTED_TARGETS)}")
    feats = _host_features().split(",")
    have = {f[1:] for f in feats if f.startswith("+")}
    need = {"avx2", "fma", "f16c"} | ({"avxvnni"} if isa == "avxvnni" else set())
    if not HOST_IS_X86 or not need <= have:
        raise ValueError(f"this CPU cannot run the {isa} target (needs {', '.join(sorted(need))})")
    wide = ("avx512", "amx", "avx10", "avxvnni", "avxifma", "avxneconvert")

    def keep(f):
        name = f[1:]
        if f.startswith("+") and name.startswith(wide) and not (isa == "avxvnni" and name == "avxvnni"):
            return "-" + name
        return f
    return {"NUMBA_CPU_NAME": RESTRICTED_TARGETS[isa], "NUMBA_CPU_FEATURES": ",".join(keep(f) for f in feats)}

_configured: int | None = None


def openblas_libs():
    """(set_num_threads, get_num_threads) ctypes functions of every OpenBLAS loaded in this process.

    Found through /proc/self/maps (Linux); numpy's OpenBLAS is ``scipy_openblas64_`` with suffixed
    symbols. Elsewhere: threadpoolctl, if installed. Cached after the first call that finds one.
    """
    global _BLAS
    if _BLAS:
        return _BLAS
    import ctypes
    found, seen = [], set()
    try:
        with open("/proc/self/maps") as fh:
            paths = {ln.split()[-1] for ln in fh
                     if "openblas" in os.path.basename(ln.rstrip()).lower() and ".so" in ln}
    except OSError:
        paths = set()
    for path in sorted(paths):
        if not os.path.isabs(path) or path in seen:
            continue
        seen.add(path)
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sfx in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                    "openblas_set_num_threads64_", "scipy_openblas_set_num_threads"):
            setter = getattr(lib, sfx, None)
            getter = getattr(lib, sfx.replace("set_num_threads", "get_num_threads"), None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                found.append((setter, getter))
                break
    if not found:
        try:
            from threadpoolctl import ThreadpoolController
            ctl = ThreadpoolController().select(internal_api="openblas")
            found = [(lambda n, c=ctl: c.limit(limits=n) and None, lambda c=ctl: c.info()[0]["num_threads"])]
        except Exception:  # noqa: BLE001 - no OpenBLAS control available: leave BLAS alone
            found = []
    _BLAS = found
    return found


_BLAS: list = []


def set_blas_threads(n: int) -> bool:
    """Set the thread count of every loaded OpenBLAS (numpy's included); False if none found."""
    libs = openblas_libs()
    for setter, _ in libs:
        setter(int(n))
    return bool(libs)


class blas_threads:
    """Context manager: run the block with OpenBLAS limited to ``n`` threads, then restore."""

    def __init__(self, n: int):
        self.n = int(n)
        self.saved: list = []

    def __enter__(self):
        libs = openblas_libs()
        self.saved = [(setter, getter()) for setter, getter in libs]
        for setter, _ in libs:
            setter(self.n)
        return self

    def __exit__(self, *exc):
        for setter, n in self.saved:
            setter(n)
        return False


def configure(threads: int | None = None) -> int:
    """Set the number of threads the kernels use and return it.

    ``threads`` None means the number of physical cores. Clamped to numba's pool size
    (``numba.config.NUMBA_NUM_THREADS``). Sets numba's count (``numba.set_num_threads``; numba
    keeps it per Python thread, so a worker thread that launches kernels must call this too) and
    every loaded OpenBLAS's (numpy's), which the prefill matmuls use. Safe to call again with
    another count.
    """
    global _configured
    n = int(threads) if threads else physical_cores()
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    if n != _configured:
        set_blas_threads(n)
    _configured = n
    return n


def configured_threads() -> int:
    """The thread count set by :func:`configure` (configuring the default first if needed)."""
    return _configured if _configured is not None else configure(None)


def on_passing_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread of its own that ends when it returns (its result
    returned, its exception raised here).

    libgomp keeps an OpenMP team for every thread that has started a parallel region, as long as
    that thread lives, and spins a team's threads between regions only while the process holds no
    more OpenMP threads than CPUs. A model loaded (warm-up, prefill) on the main thread and then
    run on another (the server's scheduler, chat's answer thread) left two teams on 2 cores and
    decoded at 0.81x the main thread's rate (71.2 against 57.7 tok/s: benchmarks/ab/thread_decode.py);
    work that ends with its thread leaves no team behind."""
    import threading

    box: list = []

    def run():
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as exc:          # handed to the caller's thread
            box.append((False, exc))
    t = threading.Thread(target=run, name="cpullm-load", daemon=True)
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value
