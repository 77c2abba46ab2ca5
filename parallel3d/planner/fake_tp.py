"""The engine's own tensor parallelism, run by the planner on one process: a fake process group.

The planner needs two things from tensor parallelism before any process exists: the shape of
every parameter a rank keeps (ZeRO's accounting) and the tensors a rank's forward and backward
create (activations, FLOPs, the collectives' volumes). It gets both from the real
``apply_tensor_parallel`` applied to a model on meta or fake tensors, with torch's fake
backend as the tp group: every collective returns at once and leaves its output as it is (a
fake tensor has no data to change), so this process runs exactly what tp rank 0 runs, shapes,
hooks, checks and refusals included, and ``comm_counter`` counts what each collective would
move. One implementation: what the planner prices is what ``initialize`` builds.

Why the fake group is the *default* group, and how it never reaches a user's job. The
tensor-parallel code asks ``torch.distributed`` for a group's rank, size and backend, which
only a registered group answers, and registering a group beside an existing default group is
a collective over that default group's ranks. So :func:`fake_tp_group` makes a fake default
group of ``tp`` ranks (this one rank 0) only in a process that has none, for the ``with``
block, and destroys it on the way out, error or not; in a process that already has one (the
planner called from ``initialize`` for ``"auto"``, inside the user's job) it refuses, and
``planner.auto`` runs the planner in a child process instead. The planner's worker processes
(``profile_store.compute``) are forked from a process that holds no group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_tp_group(world: int) -> Iterator[dist.ProcessGroup | None]:
    """A fake default process group of ``world`` ranks (this process rank 0) for the block; None at 1.

    RuntimeError in a process that already has a default group (see the module docstring).
    """
    if world == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("the planner prices tensor parallelism on a fake process group, which needs a process "
                           "without one (planner.auto plans in a child process when a group exists)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers torch's "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tp_cp_groups(tp: int, cp: int) -> Iterator[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]]:
    """A fake default group of ``tp x cp`` ranks, as :func:`fake_tp_group`, and this rank's tp group
    (ranks 0..tp-1) and cp group (every tp-th rank: the mesh's cp axis sits outside tp); None for a
    size of 1. The planner runs the engine's cp attention on the cp group (its all-to-alls and
    point-to-point sends return at once on fake tensors)."""
    with fake_tp_group(tp * cp) as world:
        if cp == 1 or tp == 1:
            yield (world if tp > 1 else None), (world if cp > 1 else None)
            return
        yield dist.new_group(list(range(tp))), dist.new_group(list(range(0, tp * cp, tp)))

