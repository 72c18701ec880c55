"""The public API, frozen: ``varlen_cp.__all__`` and ``varlen_cp.kernels.__all__`` with each
name's kind and call signature (parameter names, kinds and defaults; not annotations, whose
text differs across Python versions). Any change to the public surface fails here and is
made a reviewed diff by updating ``PUBLIC`` (and the docs) in the same commit."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC = {
    "varlen_cp": {
        "AttnMask": 'class(causal=True, window_size=(-1, -1), chunk_size=None)',
        "AttnOptions": (
            "class(*, strategy='p2p', backend='auto', validate=True, a2a_size=None, "
            'overlap_stages=None, graph_safe=False, graph_capacity=None, '
            'graph_send_capacity=None)'
        ),
        "CPPlan": ('class(cu_seqlens, cp_size, cp_rank, spec, padded_lengths, tables, '
                   'topology=None, capacity=None)'),
        "ContextParallelVarlenAttention": (
            'class(mask, options=None, group=None, *, '
            "softmax_scale=None, softmax_type='vanilla', "
            'n_heads=None, track_max_logit=False)'
        ),
        "cp_varlen_attn": (
            'function(q, k, v, plan, mask, group=None, options=None, '
            'softmax_scale=None, return_lse=False, *, return_max_logit=False, '
            "softmax_type='vanilla', sink=None)"
        ),
    },
    "varlen_cp.kernels": {
        "BlockSchedule": (
            'class(block_m, block_n, kv_range, q_range, visited_pairs, kv_full=None,'
            ' q_full=None, q_tiles=None, k_tiles=None, padded=True)'
        ),
        "block_sizes_for": 'function(backend, device, head_dim, head_dim_v, *, dtype=None)',
        "build_block_schedule": (
            'function(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,'
            ' *, causal, window_left, window_right, chunk_size, '
            'q_positions=None, k_positions=None, block_m=64, block_n=64)'
        ),
        "merge_attn_partials": 'function(out, lse, out_i, lse_i)',
        "varlen_attn": (
            'function(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,'
            ' softmax_scale=None, causal=False, window_size=(-1, -1), *, '
            'chunk_size=None, q_positions=None, k_positions=None, return_lse=False, '
            "backend='auto', schedule=None, return_max_logit=False, "
            "softmax_type='vanilla', sink=None)"
        ),
        "varlen_attn_bwd": (
            'function(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, '
            'max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, '
            'window_size=(-1, -1), *, chunk_size=None, q_positions=None, '
            "k_positions=None, backend='auto', schedule=None, dlse=None)"
        ),
        "varlen_attn_fwd": (
            'function(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, '
            'max_seqlen_k, softmax_scale=None, causal=False, window_size=(-1, -1),'
            ' *, chunk_size=None, q_positions=None, k_positions=None, '
            "backend='auto', schedule=None, return_max_logit=False)"
        ),
    },
}


def describe(obj) -> str:
    """``kind(signature)`` without annotations; dataclasses by their fields' defaults."""
    kind = "class" if inspect.isclass(obj) else "function"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{kind}(?)"
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    return f"{kind}{text}"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_and_signatures_are_frozen(module):
    mod = importlib.import_module(module)
    got = {name: describe(getattr(mod, name)) for name in mod.__all__}
    assert sorted(mod.__all__) == sorted(PUBLIC[module]), \
        f"{module}.__all__ changed: {sorted(mod.__all__)}"
    changed = {n: got[n] for n in got if got[n] != PUBLIC[module][n]}
    assert not changed, f"{module}: signatures changed (update PUBLIC and the docs): {changed}"


def test_internals_are_not_public():
    """What the CP strategies use from the kernels is internal: importable from its module,
    not from the package."""
    kernels = importlib.import_module("varlen_cp.kernels")
    for name in ("varlen_fwd_unchecked", "varlen_bwd_unchecked", "varlen_bwd_stats",
                 "resolve_backend", "merge_attn_partials_", "apply_softmax_sink",
                 "varlen_attn_unchecked"):
        assert not hasattr(kernels, name), name
