"""Helpers shared by several test modules, one module per topic (no test module imports
another; tests/package/test_layering.py checks it). ``tests/reference.py`` (the dense fp64
reference) and ``tests/dist_utils.py`` (gloo launches) stay their own modules: the
benchmarks and integration tests use them too.

- ``cp_grid``: the CP grid's batch, masks, layouts, head splits, single-device and dense
  references, a CP call on one rank, the padding check, gathers and fp32 comparisons;
- ``guards``: what a CP call may not do or must count (host reads of device data, bytes
  posted, all-reduces, any communication);
- ``softmax_extras``: the sinks / max-logit cases under CP;
- ``plan_checks``: plan invariants and the balanced layout's counts;
- ``torchtitan_models``: torchtitan's models scaled down for CPU and the trainer's shared
  process mesh (torchtitan imported lazily);
- ``launches``: one launch of gloo processes for the selected cases of a grid whose items
  are one case each;
- ``lanes``: the ``slow`` marker and ``fast_first`` (the fast lane keeps a parametrized
  test's first case).

Import from the topic module (``from tests.helpers.cp_grid import DOCS``): this package
re-exports nothing.
"""
