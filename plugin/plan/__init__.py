"""Host-side context-parallel planning: layout specs (which layout, with its own options),
layouts (which tokens each rank holds) and the CPPlan that every layer shares."""

from .cpplan import CPPlan
from .layout_spec import LAYOUTS, TE, Balanced, Contiguous, DualChunk, LayoutSpec, layout_spec
from .nodes import Topology, node_of_ranks

__all__ = ["CPPlan", "LAYOUTS", "Balanced", "Contiguous", "DualChunk", "LayoutSpec", "TE",
           "Topology", "layout_spec", "node_of_ranks"]
