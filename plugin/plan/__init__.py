"""Host-side context-parallel planning: layout specs (which layout, with its own options),
layouts (which tokens each rank holds), the CPPlan that every layer shares, and the segment
tables strategies pair ranks with."""

from .cpplan import CPPlan
from .layout_spec import LAYOUTS, TE, Balanced, Contiguous, DualChunk, LayoutSpec, layout_spec
from .segments import pair_segments

__all__ = ["CPPlan", "LAYOUTS", "Balanced", "Contiguous", "DualChunk", "LayoutSpec", "TE",
           "layout_spec", "pair_segments"]
