"""The plugin's fused kernel registration (light: numba is imported on the first call only).

``gated_delta_fused`` replaces the core's reference GATED_DELTA kernel
(``cpullm_kernels.attention.gated_delta.gated_delta``) with the same arguments and the same state layout
(conv history (conv_dim, K-1) then S (nv, dk, dv) at ``s_off``), so either can continue a
sequence the other started.
"""
from __future__ import annotations

from cpullm.plugin import KernelSpec, Op

VERSION = "1"
_impl = None


def gated_delta_fused(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, a_off, a_st,
                      o_off, o_st, nk, dk, nv, dv, conv_k, conv_w_off, dt_off, alog_off, norm_off,
                      s_off, eps, T):
    """GATED_DELTA over T tokens in one parallel region (see gated_delta_fused.py)."""
    global _impl
    if _impl is None:
        from .gated_delta_fused import gated_delta_fused as impl
        _impl = impl
    _impl(arena, state, wf, qkv_off, qkv_st, z_off, z_st, b_off, b_st, a_off, a_st, o_off, o_st,
          nk, dk, nv, dv, conv_k, conv_w_off, dt_off, alog_off, norm_off, s_off, eps, T)


def supports(node) -> bool:
    """Any Gated DeltaNet node with whole key-head groups (nv a multiple of nk) and a conv."""
    nk, nv, ck = node.attr("n_k_heads"), node.attr("n_v_heads"), node.attr("conv_kernel")
    return bool(nk and nv and nv % nk == 0 and ck and ck >= 1)


KERNEL = KernelSpec(name="qwen.gated_delta_fused", op=Op.GATED_DELTA, fn=gated_delta_fused,
                    supports=supports, version=VERSION)
