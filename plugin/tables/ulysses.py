"""Ulysses tables: the permutation that turns a group's all-to-all output into whole
documents, and the local call over them.

After the all-to-all a member holds every member's tokens (member order) for its head
slice; ``order`` lists them by (document, position), padding last in each document, which
is the order of the plan's padded global index (TransformerEngine's THD indexing for
``te``, the global token order otherwise). For the whole CP group that order is a
permutation of the padded batch, inverted by one scatter; for a subgroup it is a sort of the
members' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..kernels.host_copy import to_device
from ..masks import AttnMask
from ..plan import CPPlan
from .flash_form import FlashRoute
from .holders import Holder, KernelCall, holder_from_counts, kernel_call
from .cache import cached_table, table_key


@dataclass(frozen=True)
class UlyssesTables:
    """Token bookkeeping of one Ulysses group (host, or copied to the device)."""

    sizes: tuple[int, ...]   # local tokens of each member: the all-to-all split sizes
    order: torch.Tensor      # int64 [N]: member-concatenation row of each merged row
    inverse: torch.Tensor    # int64 [N]: merged row of each member-concatenation row
    holder: Holder           # the merged tokens (document order), host tensors
    # order / inverse / sizes are what the a2a engine reads (index_select, split sizes):
    # tensors (views of the numpy permutations) and ints, as the strategies take them.

    def to(self, device: torch.device) -> "UlyssesTables":
        order, inverse = to_device([self.order, self.inverse], device)
        return replace(self, order=order, inverse=inverse)


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def ulysses_tables(plan: CPPlan, members: tuple[int, ...],
                   device: torch.device | str | None = None) -> UlyssesTables:
    """Tables of the group made of CP ranks ``members`` (consecutive, in group-rank
    order), on the host or copied to ``device`` (cached)."""
    def build() -> UlyssesTables:
        # numpy, on the plan's arrays: the gathers and scatters over the group's tokens
        # cost ~3x less than torch's (128K tokens: ~1 ms saved per plan)
        t = plan.arrays
        rows = slice(plan.local_rows_of(members[0]).start, plan.local_rows_of(members[-1]).stop)
        padded = t.padded_index[rows]
        if len(members) == plan.cp_size:   # a permutation of the padded batch: invert it
            order = _inverse(padded)
            inverse = padded.copy()        # the inverse of the inverse
        else:
            order = np.argsort(padded, kind="stable")
            inverse = _inverse(order)
        pos = t.position[rows][order]
        doc = t.doc[rows][order]
        return UlyssesTables(tuple(plan.num_tokens_of(r) for r in members),
                             torch.from_numpy(order), torch.from_numpy(inverse),
                             holder_from_counts(doc, pos, plan.n_docs))
    return cached_table(plan, table_key("ulysses", None, None, tuple(members)), build, device)


def group_call(plan: CPPlan, members: tuple[int, ...], mask: AttnMask,
               block: tuple[int, int], device: torch.device | str | None = None,
               route: FlashRoute | None = None) -> KernelCall | None:
    """The local call over the group's merged tokens (on the host or copied to
    ``device``, cached; FA form with a ``route``: whole documents always have one); None
    when nothing is visible."""
    def build() -> KernelCall | None:
        h = ulysses_tables(plan, members).holder
        any_real = bool((h.pos >= 0).any()) if h.n_tokens else False
        return kernel_call(h, h, mask, block, route) if any_real else None
    return cached_table(plan, table_key("ulysses_call", mask, block, tuple(members),
                                          route=route),
                        build, device)
