"""`zero3d train --max-restarts 1`: a worker killed mid-training is restarted with the others, they
resume from the latest complete checkpoint by themselves, and the run ends as an uninterrupted one.

Restarted torchrun workers used to hang at start-up in a futex, with no output: torch 2.13
shares the agent's store between rounds, and the new ranks read the dead round's gloo
addresses from it (see parallel3d/launch/agent.py and parallel3d/runtime/mesh.py `_job_store`).
"""

from __future__ import annotations

import os
import signal

from tests.test_job_signals import PEER_LOSS_TIMEOUT, Job, wait_for_agent
from tests.test_train_cli import read_metrics

STEPS = ("train.max_steps=40", "train.save_interval=5", PEER_LOSS_TIMEOUT)


def numbers(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("lr"), r.get("tokens")) for r in records]


def test_a_killed_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path, cache_dir):
    """The uninterrupted run trains beside the interrupted one (once its launcher has filled the data
    cache): on two cores one job's start-up, rendezvous and restart leave a core idle."""
    full = Job(tmp_path / "a", cache_dir, *STEPS)
    job = None
    try:
        wait_for_agent(full.mark, full.launcher)
        job = Job(tmp_path / "b", cache_dir, *STEPS, "--max-restarts", "1")
        job.wait_for_step(8)  # global_step5 is saved; 32 steps are left to train when the worker dies (at a few
        # hundredths of a second a step, time enough for the kill to find it)
        os.kill(job.pid_of("worker"), signal.SIGKILL)
        assert job.launcher.wait(600) == 0, job.stderr()[-3000:]
        said = job.stderr()
        assert full.launcher.wait(600) == 0, full.stderr()[-3000:]
    finally:
        for each in (job, full):
            if each is not None:
                each.close()
    assert "rank 1 did not arrive" in said and "restarted the workers after a failure (restart 1 of 1)" in said, said
    resumed = [line for line in said.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "/checkpoints/global_step" in resumed[0], said
    assert "Traceback" not in said, said
    assert numbers(read_metrics(job.run)) == numbers(read_metrics(full.run))  # bit for bit, one history
