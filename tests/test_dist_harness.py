"""Tests of the shared multi-process harness (tests/dist_harness.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist_

from tests.dist_harness import DistTestError


def _rank_sum() -> tuple[int, int]:
    t = torch.tensor([float(dist_.get_rank())])
    dist_.all_reduce(t)
    return dist_.get_rank(), int(t.item())


def _pid_and_dtype(set_dtype: bool) -> tuple[int, str, int]:
    seen = str(torch.get_default_dtype())
    if set_dtype:  # must not leak into the next call
        torch.set_default_dtype(torch.float64)
    return os.getpid(), seen, torch.get_num_threads()


def _fail_on_rank1() -> int:
    if dist_.get_rank() == 1:
        print("output from the failing rank")
        raise ValueError("boom from rank 1")
    dist_.barrier()  # rank 0 is left waiting in a collective
    return 0


def _stuck() -> None:
    if dist_.get_rank() == 0:
        dist_.barrier()
    else:
        time.sleep(60)


def _exit_on_rank1() -> None:
    if dist_.get_rank() == 1:
        os._exit(3)
    dist_.barrier()


def _env_world() -> tuple[str, str, str, str, str]:
    e = os.environ
    return e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["DS_ACCELERATOR"], e["MASTER_PORT"]


def _mesh_tp_sum() -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    t = torch.tensor([float(dist_.get_rank())])
    dist_.all_reduce(t, group=mesh.get_group("tp"))
    return int(t.item()), len(dist_.distributed_c10d._world.pg_map)


@pytest.mark.parametrize("world", [2, 4])
def test_results_by_rank(dist, world):
    total = sum(range(world))
    assert dist.run(world, _rank_sum) == [(r, total) for r in range(world)]
    env = dist.run(world, _env_world)
    assert [e[:4] for e in env] == [(str(r), str(world), str(r), "cpu") for r in range(world)]
    assert len({e[4] for e in env}) == 1


def test_pool_reused_and_state_reset(dist):
    first = dist.run(2, _pid_and_dtype, True)
    second = dist.run(2, _pid_and_dtype, set_dtype=False)
    assert [r[0] for r in first] == [r[0] for r in second]
    assert all(r[1] == "torch.float32" and r[2] == 1 for r in second)


def test_mesh_subgroups_do_not_accumulate(dist):
    first = dist.run(4, _mesh_tp_sum)
    assert [r[0] for r in first] == [1, 1, 5, 5]  # tp pairs (0,1) and (2,3)
    assert dist.run(4, _mesh_tp_sum) == first


def test_exception_reports_rank_and_traceback(dist):
    pids = dist.pool(2).pids() or [r[0] for r in dist.run(2, _pid_and_dtype, False)]
    with pytest.raises(DistTestError) as info:
        dist.run(2, _fail_on_rank1)
    msg = str(info.value)
    assert "rank 1 raised ValueError: boom from rank 1" in msg
    assert "Traceback (most recent call last)" in msg and "_fail_on_rank1" in msg
    assert "output from the failing rank" in msg
    assert "rank 0" not in msg.split("---")[1]  # only the failing rank's traceback
    after = dist.run(2, _pid_and_dtype, False)
    assert [r[0] for r in after] != pids  # killed and respawned


def test_timeout_names_function_and_ranks(dist):
    t0 = time.monotonic()
    with pytest.raises(DistTestError) as info:
        dist.run(2, _stuck, timeout=3)
    assert time.monotonic() - t0 < 15
    msg = str(info.value)
    assert "_stuck timed out after 3 s in world 2" in msg and "ranks [0, 1] had not finished" in msg
    assert "in _stuck" in msg  # faulthandler stack dump of the stuck ranks
    assert dist.run(2, _rank_sum) == [(0, 1), (1, 1)]


def test_dead_rank_reports_exit_code(dist):
    with pytest.raises(DistTestError, match="rank 1 died with exit code 3"):
        dist.run(2, _exit_on_rank1)
    assert dist.run(2, _rank_sum) == [(0, 1), (1, 1)]
