"""varlen-cp integration suite: CP parity and training parity on a real multi-process job.

Run it with ``torchrun [...] -m integration_tests.run`` (one node or many, gloo on CPU,
NCCL on GPUs) or through the sbatch templates in ``integration_tests/slurm/``; see
``integration_tests/README.md``. ``harness`` (registry, timeouts, summary) imports no torch,
so its unit tests stay fast.
"""
