"""The trainer builds the next batch's plan (and its tables) while the current step runs.

With the plan builder slowed by PLAN_S per batch and a step that takes STEP_S > PLAN_S, the
mean step time (torchtitan's ``train_step``: waiting for the batch and its plan, sharding,
forward, backward, optimizer) stays at the baseline when prefetching, and grows by about
PLAN_S with ``[varlen_cp] prefetch = false``. The slow step is a sleep, so the result does
not depend on how busy the machine's cores are; margins are half the planner's time.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)

from tests.dist_utils import run_distributed  # noqa: E402

PLAN_S, STEP_S = 0.25, 0.5
STEPS, WARMUP = 7, 2  # the first steps wait for the first plan and warm caches up
TOML = """
[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 256
ffn_hidden_dim = 128
attention_chunk_size = 64
nope_layer_interval = 2
max_seq_len = 512
[training]
seq_len = 512
steps = 10
[dataloader]
alphabet = 128
min_doc_len = 12
[metrics]
log_freq = 1
"""


def timing_worker(rank: int, world: int, tmp: str) -> dict[str, list[float]]:
    """Step times of three trainers: baseline, slow planner, slow planner without
    prefetching; every step made STEP_S longer by a sleep in forward_backward_step."""
    from tests.helpers.torchtitan_models import start_torchtitan_worker

    toml = start_torchtitan_worker(rank, world, tmp, TOML)  # before torchtitan imports
    from varlen_cp.integrations.torchtitan import trainer as trainer_module
    from varlen_cp.integrations.torchtitan.config import load_config

    build_plan = trainer_module.build_plan

    def slow_build_plan(*args, **kwargs):
        time.sleep(PLAN_S)
        return build_plan(*args, **kwargs)

    out = {}
    for name, slow, prefetch in (("baseline", False, True), ("prefetch", True, True),
                                 ("no_prefetch", True, False)):
        trainer_module.build_plan = slow_build_plan if slow else build_plan
        config = load_config(["--config", str(toml), "--job.dump_folder", f"{tmp}/{name}",
                              "--varlen_cp.prefetch", str(prefetch).lower()], cpu=True)
        trainer = config.build()
        step = trainer.forward_backward_step

        def slow_step(**kwargs):
            time.sleep(STEP_S)
            return step(**kwargs)

        trainer.forward_backward_step = slow_step
        times = []
        try:
            batches = trainer.batch_generator(trainer.dataloader)
            for i in range(1, STEPS + 1):
                trainer.step = i
                start = time.perf_counter()
                trainer.train_step(batches)
                times.append(time.perf_counter() - start)
        finally:
            trainer.close()
        out[name] = times[WARMUP:]
    trainer_module.build_plan = build_plan
    return out


@pytest.mark.slow  # three trainers with a slowed planner
def test_plan_building_overlaps_the_step(tmp_path):
    times = run_distributed(timing_worker, 1, tmp_path, str(tmp_path), timeout_s=300)[0]
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    detail = {k: [round(t, 3) for t in v] for k, v in times.items()}
    assert mean["baseline"] > STEP_S, detail
    # Prefetching hides the planner (it would add PLAN_S = 0.25 s per step) ...
    assert mean["prefetch"] - mean["baseline"] < 0.5 * PLAN_S, detail
    # ... which is really there: without prefetching every step waits for it.
    assert mean["no_prefetch"] - mean["baseline"] > 0.7 * PLAN_S, detail
