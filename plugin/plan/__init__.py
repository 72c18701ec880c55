"""Host-side context-parallel planning: layouts (which tokens each rank holds), the CPPlan
that every layer shares, and the segment tables strategies pair ranks with."""

from .cpplan import CPPlan
from .layouts import LAYOUTS
from .segments import pair_segments

__all__ = ["CPPlan", "LAYOUTS", "pair_segments"]
