"""Entry point of the integration suite.

    torchrun --nproc-per-node N -m integration_tests.run [--tests GLOB ...] [--list]
    srun ... torchrun --nnodes $SLURM_NNODES ... -m integration_tests.run   (see slurm/)

Prints one PASS / FAIL / SKIP line per test (rank 0), then
``integration: N passed, N failed, N skipped in T s (...)``. Exit status: 0 when nothing
failed, 1 when a test failed, 2 on bad arguments, 3 when a test ran past its timeout (that
rank exits at once; torchrun / srun then stop the others).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from . import harness


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m integration_tests.run",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tests", nargs="+", metavar="GLOB",
                   help="run only tests whose name matches a glob (e.g. 'cp_parity/*')")
    p.add_argument("--list", action="store_true", help="list the tests and exit")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="per-test timeout in seconds for every test (default: each test's own)")
    p.add_argument("--collective-timeout", type=float, default=300.0, metavar="S",
                   help="timeout of every collective (init_process_group), default 300")
    args = p.parse_args(argv)
    for name in ("timeout", "collective_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    return args


def _load_tests() -> dict[str, harness.TestSpec]:
    # Importing the modules registers their tests, in this order.
    from . import cp_parity, job_checks, training_parity  # noqa: F401
    order = ["job/", "cp_parity/", "training_parity/"]
    return dict(sorted(harness.REGISTRY.items(),
                       key=lambda kv: next(i for i, p in enumerate(order)
                                           if kv[0].startswith(p))))


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    # torch 2.13+ deprecates the name of a collective the plan and strategies call; one
    # warning per rank and call site would bury the PASS / FAIL lines.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated",
                            category=FutureWarning)
    import torch
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # CPU ranks share the node's cores
    registry = _load_tests()
    if args.list:
        for t in registry.values():
            print(f"{t.name:32s} {t.timeout_s:6.0f} s  {t.doc}")
        return harness.EXIT_OK
    try:
        tests = harness.select(registry, args.tests)
    except ValueError as e:
        print(f"integration: {e}", file=sys.stderr)
        return harness.EXIT_USAGE

    from . import dist_env
    ctx = dist_env.init(args.collective_timeout)
    if ctx.rank == 0:
        print(f"integration: {len(tests)} tests, {ctx.describe()}", flush=True)
    suite = harness.Suite(rank=ctx.rank, agree=ctx.agree, where=ctx.describe(),
                          timeout_override_s=args.timeout)
    try:
        return suite.run(tests, ctx)
    finally:
        dist_env.shutdown()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is agreed and printed and the process groups are destroyed: leave without
    # the interpreter's finalization, where a torch runtime thread torn down late once
    # aborted a rank of a run whose every test had passed (SIGABRT, "terminate called
    # without an active exception", CI of 2026-11-28).
    os._exit(code)
