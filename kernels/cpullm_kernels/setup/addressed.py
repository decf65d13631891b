"""Calls from one compiled kernel to another through the callee's address, not by linking it.

numba links every callee's LLVM module into its caller, then optimizes and generates machine code
for the whole tree again there, so a large kernel costs its compile once per caller above it: on
a cold start of the default model (2-core Zen 4) ``interpreter.run`` took 5.5 s of CPU re-compiling
attention and the LINEAR driver it had just loaded, and the batched step ``run.batch._fused``
27-29 s re-compiling everything. A call through :class:`Addressed` is an indirect call of the
callee's own compiled function, so the caller's compile stays the size of its own code.

How: each declared signature of a callee gets a cell (8 bytes this module owns) registered in
LLVM's symbol table as ``cpullm_at_<key>`` (the key hashes the callee's name and signature). The
caller's code loads the cell and calls the address in it with numba's own calling convention, so
arrays, return values and exceptions pass as in a linked call. An empty cell is filled on first
use: the caller calls back into Python (:func:`_bind_by_key`), which compiles (or loads from
numba's cache) the callee's specialization and writes its address; :meth:`Addressed.bind` does the
same ahead of time. The callback takes the GIL, so a worker thread of a parallel region must
never be the one to bind (it would wait for the GIL its caller holds): a parallel kernel that
calls through an address binds first, before its region, with ``ensure`` (attention does).

The signatures are declared, not inferred, because a caller loaded from numba's cache references
its cells before any typing runs: every cell is registered when its declaration is imported, and
the caller's typing accepts only declared signatures (:meth:`Addressed.match`: a literal as its
type, a number or array that passes unchanged). A caller cached before one of its callee's
signatures was removed references a cell nobody registers, and LLVM stops the process when it
loads it: clear numba's cache after changing a declaration, as after any change of a callee
(numba does not follow callees' sources).
"""
from __future__ import annotations

import ctypes
import hashlib

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.callconv import excinfo_t
from numba.core.errors import TypingError
from numba.extending import intrinsic

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_BY_KEY: dict = {}          # key -> (Addressed, signature index), for the bind callback


def _key(dispatcher, restype, argtypes) -> int:
    """A 63-bit key of a callee and signature, the same in every process."""
    f = dispatcher.py_func
    text = f"{f.__module__}.{f.__qualname__}|{restype}|{','.join(map(str, argtypes))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64)
def _bind_by_key(key):
    """Called from compiled code through an empty cell: bind it. 0 on success."""
    try:
        owner, i = _BY_KEY[key]
        owner.bind(owner.signatures[i])
        return 0
    except BaseException:  # noqa: BLE001 - the caller raises RuntimeError naming the kernel
        return 1


_CALLBACK = np.array([ctypes.cast(_bind_by_key, ctypes.c_void_p).value], np.int64)
_CALLBACK_SYMBOL = "cpullm_at_bind_v1"
llvm.add_symbol(_CALLBACK_SYMBOL, _CALLBACK.ctypes.data)


def _widens(a, d) -> bool:
    """A value of type ``a`` passes as type ``d`` unchanged: a number that converts without loss,
    an array as a read-only one or as one of any layout (the same data structure)."""
    if isinstance(a, types.Array) and isinstance(d, types.Array):
        return (a.dtype == d.dtype and a.ndim == d.ndim and d.layout in (a.layout, "A")
                and (a.mutable or not d.mutable))
    if isinstance(a, types.Float) and isinstance(d, types.Float):
        return a.bitwidth <= d.bitwidth
    if isinstance(a, types.Integer) and isinstance(d, types.Integer):
        return a.signed == d.signed and a.bitwidth <= d.bitwidth
    return isinstance(a, types.Boolean) and isinstance(d, types.Boolean)


def _external(module, name: str, ty):
    """The module's declaration of the external global ``name`` (one per module)."""
    g = module.globals.get(name)
    if g is None:
        g = ir.GlobalVariable(module, ty, name)
        g.linkage = "external"
    return g


class Addressed:
    """A compiled function called through its address from other compiled code.

    ``dispatcher``: the callee (an ``@njit`` function); ``restype``: what it returns;
    ``signatures``: every argument-type tuple a caller may call it with. ``call`` is the
    intrinsic a caller uses in place of the function (``ATTENTION.call(arena, ...)``), ``bind``
    makes a signature callable in this process."""

    def __init__(self, dispatcher, restype, signatures):
        self.dispatcher = dispatcher
        self.name = dispatcher.py_func.__qualname__
        self.restype = restype
        self.signatures = [tuple(s) for s in signatures]
        if len(set(self.signatures)) != len(self.signatures):
            raise ValueError(f"addressed {self.name}: a signature is declared twice")
        self.keys = [_key(dispatcher, restype, s) for s in self.signatures]
        self.symbols = [f"cpullm_at_{k:016x}" for k in self.keys]
        self.cells = np.zeros(len(self.signatures), np.int64)      # the addresses; 0: not bound
        for i, (key, sym) in enumerate(zip(self.keys, self.symbols)):
            _BY_KEY[key] = (self, i)
            llvm.add_symbol(sym, self.cells.ctypes.data + 8 * i)
        self.call = self._intrinsic()

    def match(self, argtypes) -> int | None:
        """The index of the declared signature these caller argument types call, or None: equal
        types (a scalar literal as its type), else of the signatures whose every argument is equal
        or passes unchanged (:func:`_widens`: float32 -> float64, an array as a read-only one),
        the one with the most equal arguments."""
        plain = tuple(types.unliteral(t) for t in argtypes)
        if plain in self.signatures:
            return self.signatures.index(plain)
        near = [(sum(a == d for a, d in zip(plain, s)), i) for i, s in enumerate(self.signatures)
                if len(s) == len(plain) and all(a == d or _widens(a, d) for a, d in zip(plain, s))]
        near.sort(reverse=True)
        if not near or (len(near) > 1 and near[0][0] == near[1][0]):
            return None
        return near[0][1]

    def bind(self, argtypes) -> None:
        """Compile (or load) the callee for ``argtypes`` (a declared signature) and put its address
        in the signature's cell."""
        i = self.match(argtypes)
        if i is None:
            raise ValueError(f"addressed {self.name}: {tuple(argtypes)} is not a declared signature")
        if self.cells[i]:
            return
        sig = self.signatures[i]
        self.dispatcher.compile(sig)
        cres = self.dispatcher.overloads[sig]
        if cres.signature.return_type != self.restype:
            raise TypeError(f"addressed {self.name}: returns {cres.signature.return_type}, "
                            f"declared {self.restype}")
        self.cells[i] = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)

    def bound(self, argtypes) -> bool:
        i = self.match(argtypes)
        return i is not None and bool(self.cells[i])

    def _typed(self, args):
        i = self.match(args)
        if i is None:
            raise TypingError(f"addressed {self.name}: called with {args}, which is not one of its "
                              f"declared signatures (cpullm_kernels.setup.addressed)")
        return i

    def _cell(self, context, builder, i):
        """The loaded address of signature i, bound first (through the callback) if empty."""
        cc = context.call_conv
        cell = _external(builder.module, self.symbols[i], _I64)
        with cgutils.if_unlikely(builder, builder.icmp_unsigned("==", builder.load(cell), ir.Constant(_I64, 0))):
            cbty = ir.FunctionType(_I32, [_I64])
            cb = builder.inttoptr(builder.load(_external(builder.module, _CALLBACK_SYMBOL, _I64)), cbty.as_pointer())
            failed = builder.icmp_unsigned("!=", builder.call(cb, [ir.Constant(_I64, self.keys[i])]),
                                           ir.Constant(_I32, 0))
            with cgutils.if_unlikely(builder, failed):
                cc.return_user_exc(builder, RuntimeError,
                                   (f"cpullm: the kernel {self.name} could not be compiled or loaded; "
                                    "call it once from Python to see why",))
        return builder.load(cell)

    def _intrinsic(self):
        owner = self

        def call_typer(typingctx, *args):
            i = owner._typed(args)
            declared = owner.signatures[i]
            sig = owner.restype(types.StarArgTuple.from_types(args))

            def codegen(context, builder, sig, llargs):
                tup, actual = llargs[0], sig.args[0].types
                vals = [context.cast(builder, builder.extract_value(tup, j), actual[j], declared[j])
                        for j in range(len(declared))]
                cc = context.call_conv
                addr = owner._cell(context, builder, i)
                fnty = cc.get_function_type(owner.restype, declared)
                fn = builder.inttoptr(addr, fnty.as_pointer())
                retty = cc.get_return_type(owner.restype).pointee
                ret = cgutils.alloca_once(builder, retty)
                builder.store(cgutils.get_null_value(retty), ret)
                exc = cgutils.alloca_once(builder, ir.PointerType(excinfo_t), name="excinfo")
                packed = list(cc._get_arg_packer(declared).as_arguments(builder, vals))
                code = builder.call(fn, [ret, exc] + packed)
                status = cc._get_return_status(builder, code, builder.load(exc))
                with cgutils.if_unlikely(builder, status.is_error):
                    cc.return_status_propagate(builder, status)
                return context.get_returned_value(builder, owner.restype, builder.load(ret))
            return sig, codegen

        def ensure_typer(typingctx, *args):
            i = owner._typed(args)
            sig = types.none(types.StarArgTuple.from_types(args))

            def codegen(context, builder, sig, llargs):
                owner._cell(context, builder, i)
                return context.get_dummy_value()
            return sig, codegen

        call_typer.__name__ = f"call_{self.name}"
        ensure_typer.__name__ = f"ensure_{self.name}"
        self.ensure = intrinsic(ensure_typer)
        """``ensure(*args)``: bind the signature of these argument types now, without calling. A
        parallel kernel calls it before its parallel region, whose calls then find the cell full."""
        return intrinsic(call_typer)
