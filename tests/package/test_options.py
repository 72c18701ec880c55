"""The options along the spine: ``AttnOptions`` (how an attention call runs), the layout
specs (tests/plan/test_plan.py), and ``CPConfig`` composing both with its unchanged keys.

- ``AttnOptions``: defaults, frozen and hashable, every field checked when built with a
  ValueError naming it; the strategy-bound options (``a2a_size``, ``overlap_stages``) only
  with the strategies that take them, one rule for one strategy and for megatron's
  per-layer tuples (``check_taken``).
- ``CPConfig``: the same fields (TOML keys) as before; ``attn_options`` and
  ``layout_spec(masks)`` are the objects the op and the plan take, and its checks are theirs
  (same messages).
- ``cp_varlen_attn`` and the module take their options one way, an ``AttnOptions`` (the
  keywords of the unreleased 0.1.0 are gone).
Host only, well under a second.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.cp_grid import cu, global_inputs
from varlen_cp import AttnMask, AttnOptions, ContextParallelVarlenAttention, CPPlan
from varlen_cp.attention import cp_varlen_attn
from varlen_cp.config import CPConfig
from varlen_cp.options import STAGED_STRATEGIES, STRATEGY_CHOICES, check_taken, takes
from varlen_cp.plan import TE, Balanced, Contiguous, DualChunk, layout_spec


def test_attn_options_defaults_and_identity() -> None:
    opts = AttnOptions()
    assert (opts.strategy, opts.backend, opts.validate, opts.a2a_size,
            opts.overlap_stages, opts.graph_safe, opts.graph_capacity,
            opts.graph_send_capacity) == ("p2p", "auto", True, None, None, False, None, None)
    assert [f.name for f in dataclasses.fields(AttnOptions)] == \
        ["strategy", "backend", "validate", "a2a_size", "overlap_stages", "graph_safe",
         "graph_capacity", "graph_send_capacity"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.strategy = "a2a"
    assert hash(AttnOptions(strategy="dispatch", overlap_stages=2)) == \
        hash(AttnOptions(strategy="dispatch", overlap_stages=2))
    assert {n: takes(n, "overlap_stages") for n in STRATEGY_CHOICES} == {
        "p2p": False, "all_gather": True, "a2a": False, "a2a+p2p": False, "dispatch": True,
        "auto": True}
    assert set(STAGED_STRATEGIES) == {"all_gather", "dispatch", "auto"}


@pytest.mark.parametrize("kw, match", [
    ({"strategy": "ring"}, "strategy must be one of"),
    ({"strategy": None}, "strategy must be one of"),
    ({"backend": "cuda"}, "backend must be one of"),
    ({"validate": 1}, "validate must be a bool"),
    ({"strategy": "a2a+p2p", "a2a_size": 0}, "a2a_size must be None or an int >= 1"),
    ({"strategy": "a2a+p2p", "a2a_size": True}, "a2a_size"),
    ({"strategy": "a2a+p2p", "a2a_size": 2.0}, "a2a_size"),
    ({"a2a_size": 2}, "a2a_size applies to strategy 'a2a[+]p2p' only, got a2a_size=2 with "
                      "strategy='p2p'"),
    ({"strategy": "auto", "a2a_size": 2}, "a2a_size applies"),
    ({"strategy": "dispatch", "overlap_stages": 0}, "overlap_stages"),
    ({"strategy": "dispatch", "overlap_stages": "2"}, "overlap_stages"),
    ({"strategy": "a2a", "overlap_stages": 2}, "overlap_stages applies to strategies"),
])
def test_attn_options_reject(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        AttnOptions(**kw)


def test_strategy_bound_options_one_rule() -> None:
    """One rule for one strategy (AttnOptions) and for a list of layers' strategies
    (megatron): taken when some strategy of the list takes it; unknown strategies (None,
    megatron's cp_comm_type) leave only the type check."""
    assert AttnOptions(strategy="auto", overlap_stages=3).overlap_stages == 3
    assert check_taken("overlap_stages", 3, ("p2p", "dispatch")) == 3
    assert check_taken("a2a_size", 2, None) == 2
    with pytest.raises(ValueError, match=r"a2a_size applies to strategy 'a2a\+p2p' only, got "
                                         r"a2a_size=2 with strategy=\('p2p', 'a2a'\)"):
        check_taken("a2a_size", 2, ("p2p", "a2a"))
    with pytest.raises(ValueError, match="a2a_size must be None or an int >= 1"):
        check_taken("a2a_size", -1, None)


def test_cpconfig_keys_and_composition() -> None:
    """Same keys as before the split (the TOML surface), and the two objects it composes
    carry exactly its values; its rules are theirs."""
    assert [f.name for f in dataclasses.fields(CPConfig)] == [
        "strategy", "layout", "backend", "flash_impl", "a2a_size", "overlap_stages",
        "validate", "graph_safe", "graph_capacity", "graph_send_capacity",
        "min_chunk_tokens", "tile_tokens", "pad_multiple", "gpus_per_node",
        "node_bandwidth", "cross_node_bandwidth", "prefetch", "report"]
    cfg = CPConfig(strategy="a2a+p2p", a2a_size=2, backend="torch", validate=False,
                   layout="dual_chunk", min_chunk_tokens=8)
    assert cfg.attn_options == AttnOptions(strategy="a2a+p2p", a2a_size=2, backend="torch",
                                           validate=False)
    assert cfg.layout_spec() == DualChunk(min_chunk_tokens=8)
    assert CPConfig().layout_spec() == Balanced()
    masks = [(AttnMask(chunk_size=64), 3), (AttnMask(), 1)]
    assert CPConfig(tile_tokens=32).layout_spec(masks) == Balanced(masks=masks, tile_tokens=32)
    assert CPConfig(layout="te").layout_spec(masks) == TE()          # masks: balanced only
    assert CPConfig(layout="te", pad_multiple=16).layout_spec() == TE(pad_multiple=16)
    assert CPConfig(layout="contiguous").layout_spec() == Contiguous()
    for kw in ({"strategy": "p2p", "a2a_size": 2}, {"strategy": "a2a", "overlap_stages": 2},
               {"backend": "gpu"}):
        with pytest.raises(ValueError) as ours:
            CPConfig(**kw)
        with pytest.raises(ValueError) as theirs:
            AttnOptions(**kw)
        assert str(ours.value) == str(theirs.value)
    for kw in ({"min_chunk_tokens": 64}, {"layout": "te", "tile_tokens": 64},
               {"layout": "dual_chunk", "pad_multiple": 8}, {"tile_tokens": 0}):
        layout = kw.pop("layout", "balanced")
        with pytest.raises(ValueError) as ours:
            CPConfig(layout=layout, **kw)
        with pytest.raises(ValueError) as theirs:
            layout_spec(layout, **kw)
        assert str(ours.value) == str(theirs.value)


def test_options_are_given_one_way() -> None:
    """An AttnOptions (or None: the defaults) and nothing else: the 0.1.0 keywords and a
    strategy name in the options' place are refused."""
    docs = [7, 1, 12]
    plan = CPPlan.build(cu(docs), cp_size=1, cp_rank=0)
    q, k, v, _ = global_inputs(docs, 4, 2, seed=0)
    mask = AttnMask(chunk_size=4)
    out = cp_varlen_attn(q, k, v, plan, mask, None,
                         AttnOptions(strategy="a2a+p2p", a2a_size=1, backend="torch"))
    ref = cp_varlen_attn(q, k, v, plan, mask, None, AttnOptions(backend="torch"))
    assert torch.equal(out, ref)   # cp 1: every strategy is the local op
    assert ContextParallelVarlenAttention(mask).options == AttnOptions()
    module = ContextParallelVarlenAttention(mask, AttnOptions(strategy="dispatch",
                                                              overlap_stages=2))
    assert module.strategy == "dispatch"
    for bad in ("p2p", {"strategy": "p2p"}):
        with pytest.raises(ValueError, match="options must be a varlen_cp.AttnOptions"):
            cp_varlen_attn(q, k, v, plan, mask, None, bad)
        with pytest.raises(ValueError, match="options must be a varlen_cp.AttnOptions"):
            ContextParallelVarlenAttention(mask, bad)
    for old in ("strategy", "backend", "validate", "a2a_size", "overlap_stages"):
        with pytest.raises(TypeError, match=old):
            cp_varlen_attn(q, k, v, plan, mask, **{old: None})
        with pytest.raises(TypeError, match=old):
            ContextParallelVarlenAttention(mask, **{old: None})
    with pytest.raises(TypeError):   # positions after group are keywords
        ContextParallelVarlenAttention(mask, AttnOptions(), None, 0.5)


def test_flash_impl_is_checked_when_the_config_is_built() -> None:
    """``flash_impl``: None, "FA3" or "FA4"; anything else names the key and the value."""
    assert CPConfig(flash_impl="FA4").flash_impl == "FA4"
    assert CPConfig().flash_impl is None
    for bad in ("fa3", "FA2", 3):
        with pytest.raises(ValueError, match=r"flash_impl must be one of \('FA3', 'FA4'\)"):
            CPConfig(flash_impl=bad)
