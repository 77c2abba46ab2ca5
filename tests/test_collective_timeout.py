"""A stalled rank ends the job after ``comm.timeout_s`` with a message naming the operation, the
group and the rank that did not arrive (parallel3d/runtime/watchdog.py), instead of a silent hang."""

from __future__ import annotations

import os
import re
import signal

import torch
import torch.distributed as dist

import parallel3d
from parallel3d.errors import CollectiveError
from tests.tiny import SEQ, VOCAB, ds_config, make_model

TIMEOUT_S = 10  # short, yet long enough that a loaded machine does not trip it during start-up


def _stall_rank_1() -> str:
    """Rank 1 stops itself (SIGSTOP) after one step; rank 0's next step must fail with a message.

    Rank 0 then continues rank 1 (SIGCONT) and leaves the group, so rank 1's next collective
    fails too; the default group is destroyed, so the pool starts fresh after this test.
    """
    rank = dist.get_rank()
    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    config = {**ds_config(2, 1, 2), "comm": {"timeout_s": TIMEOUT_S}}
    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=config)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
        said = "no error"
    except CollectiveError as exc:
        said = str(exc)
    except RuntimeError as exc:  # rank 1, continued after rank 0 left: whatever it hits is fine here
        said = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    dist.destroy_process_group()
    return said


def test_stalled_rank_is_named_after_the_timeout(dist):
    said = dist.run(2, _stall_rank_1, timeout=180)
    pattern = (rf"rank 0: \w+ #\d+ on process group world \(ranks 0, 1\) did not complete within {TIMEOUT_S} s "
               r"\(comm.timeout_s\): rank 1 did not arrive \(no answer, no heartbeat: stopped, hung or dead\) "
               r"\(.*[Tt]imed out.*\)")
    assert re.fullmatch(pattern, said[0]), said
    assert said[1] != "no error", said
