"""Command-line tools of varlen-cp that need no GPU and no framework.

- ``plan`` (``varlen-cp-plan``): the plan report and its plots for a job file or flags and
  a list of document lengths.
- ``loss_curve``: the demo's loss-curve PNG from its loss files (``scripts/run_demo.sh``).

Modules: ``jobs`` (job files and flags), ``lengths`` (document lengths and packing),
``plots`` (matplotlib, optional).
"""
