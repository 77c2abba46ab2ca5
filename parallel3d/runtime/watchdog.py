"""Collectives that cannot hang in silence: a timeout on every group, and a message naming who is missing.

torch sets no timeout a job would notice (30 minutes on gloo, and sub-groups do not inherit the
default group's), and when a collective fails gloo says only "Timed out waiting 300000ms for
recv operation" or "Connection closed by peer". Three pieces turn that into one sentence:

* every group gets ``comm.timeout_s`` (`set_timeout`);
* torch's flight recorder (kept small: the last `FLIGHT_RECORDER_ENTRIES` collectives) tells a
  rank which operation, on which group and with which sequence number, it was in;
* a heartbeat thread per rank bumps a counter in the job's store every ``interval`` seconds
  and, when another rank asks, posts the last collective its main thread entered. A rank
  whose collective fails asks its group, waits two intervals, and names each rank that did not
  arrive: silent (stopped, hung or dead) or busy elsewhere (another operation or group).

NCCL reports its own timeouts from its watchdog thread, which ends the process before Python
sees an exception; the timeout is set there too, and NCCL's message names the operation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from parallel3d.errors import CollectiveError
from parallel3d.runtime.fake_backend import is_fake

logger = logging.getLogger(__name__)

FLIGHT_RECORDER_ENTRIES = "64"
_FAILURE = re.compile(r"Timed out|timed out|Connection closed by peer|Connection reset by peer|Broken pipe|"
                      r"connectFullMesh|Socket Timeout|DistBackendError")


def prepare_flight_recorder() -> None:
    """Before the first process group: record this rank's last collectives (unless the user chose how many)."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES


def set_timeout(groups: Iterable[dist.ProcessGroup], seconds: float) -> None:
    """Give every group in ``groups`` (None entries skipped) a collective timeout of ``seconds``."""
    for group in groups:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER and not is_fake(group):
            c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def is_collective_failure(exc: BaseException) -> bool:
    """A timeout or a lost peer reported by the communication backend (not our own errors)."""
    if isinstance(exc, CollectiveError):
        return False
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and bool(_FAILURE.search(str(exc))))


def backend_reason(exc: BaseException) -> str:
    """The first sentence of a backend's message, without its source location."""
    return str(exc).split("] ", 1)[-1].splitlines()[0].split(". ")[0][:160]


def last_collective(thread_ident: int | None) -> dict | None:
    """The last collective the thread ``thread_ident`` entered, from torch's flight recorder."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except (ImportError, RuntimeError, ValueError):
        return None
    mine = [e for e in entries if thread_ident is None or e.get("thread_id") == str(thread_ident)]
    if not mine:
        return None
    e = mine[-1]
    name, desc = (e.get("process_group") or ["", ""])[:2]
    return {"op": str(e.get("profiling_name", "?")).split(":")[-1], "group": name, "desc": desc,
            "seq": e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id"),
            "since": e.get("time_created_ns", 0) / 1e9}


def _group_of(name: str) -> dist.ProcessGroup | None:
    return next((pg for pg, pg_name in c10d._world.pg_names.items() if pg_name == name), None)


def describe_group(name: str, desc: str) -> tuple[str, list[int]]:
    """("dp", [0, 2]) for a mesh group, ("world", [...]) for the default one."""
    group = _group_of(name)
    ranks = dist.get_process_group_ranks(group) if group is not None else []
    label = "world" if desc == "default_pg" else desc.removeprefix("mesh_") if desc else f"#{name}"
    return label, ranks


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class Watchdog:
    """This rank's heartbeat, and the explanation of a failed collective (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.interval = min(10.0, max(0.5, timeout_s / 10))
        self._store = dist.PrefixStore("zero3d/watchdog/", store)
        self._main = threading.get_ident()
        self._answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zero3d-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def for_default_group(cls, timeout_s: float) -> Watchdog | None:
        """A watchdog over the default group's store; None in a single process and on the fake backend
        (one simulated rank: no peers to ask, no store to beat on)."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or is_fake():
            return None
        return cls(c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), timeout_s)

    def close(self, wait_s: float = 2.0) -> None:
        """Stop the heartbeat and wait (at most ``wait_s``) for the thread to leave the store.

        Called at exit too (the engine's finalizer): a daemon thread still inside a store call
        when the interpreter finalizes is killed as it takes the GIL back, inside a C++
        destructor, which aborts the process.
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._store.add(f"beat/{self.rank}", 1)
                asked = self._store.add("ask", 0)
                if asked > self._answered:
                    self._answered = asked
                    answer = {"asked": asked, "last": last_collective(self._main), "now": time.time()}
                    self._store.set(f"answer/{self.rank}", json.dumps(answer))
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): stop beating
                return

    @contextlib.contextmanager
    def explaining(self) -> Iterator[None]:
        """Turn a backend's timeout or lost-peer error inside the block into a `CollectiveError`."""
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            if not is_collective_failure(exc):
                raise
            raise CollectiveError(self.explain(exc)) from None

    def explain(self, exc: BaseException) -> str:
        """One sentence: which operation on which group failed here, and who did not arrive."""
        mine = last_collective(self._main)
        timed_out = "imed out" in str(exc) or "Timeout" in str(exc)
        how = (f"did not complete within {self.timeout_s:g} s (comm.timeout_s)" if timed_out else
               "failed: a peer closed its connection (it ended or was killed)")
        backend = backend_reason(exc)
        if mine is None:
            return f"rank {self.rank}: a collective {how} ({backend})"
        label, ranks = describe_group(mine["group"], mine["desc"])
        what = f"{mine['op']} #{mine['seq']} on process group {label} (ranks {_ranks(ranks)})"
        try:
            missing = self._missing(mine, [r for r in ranks if r != self.rank])
        except Exception as err:  # noqa: BLE001 - the store may be gone too
            missing = f"the other ranks could not be asked ({type(err).__name__})"
        return f"rank {self.rank}: {what} {how}: {missing} ({backend})"

    def _missing(self, mine: dict, peers: list[int]) -> str:
        """Ask ``peers`` where they are; describe those that are not in ``mine``."""
        if not peers:
            return "no other rank in the group"
        beats = {r: self._store.add(f"beat/{r}", 0) for r in peers}
        asked = self._store.add("ask", 1)
        deadline = time.monotonic() + 2 * self.interval + 0.5
        answers: dict[int, dict] = {}
        while time.monotonic() < deadline and len(answers) < len(peers):
            time.sleep(0.1)
            for r in peers:
                if r not in answers and self._store.check([f"answer/{r}"]):
                    answer = json.loads(self._store.get(f"answer/{r}"))
                    if answer["asked"] >= asked:
                        answers[r] = answer
        notes = []
        for r in peers:
            if r not in answers:
                alive = self._store.add(f"beat/{r}", 0) != beats[r]
                notes.append(f"rank {r} did not arrive (" + ("no answer, though its heartbeat runs" if alive else
                                                             "no answer, no heartbeat: stopped, hung or dead") + ")")
                continue
            last = answers[r]["last"]
            if last is not None and last["group"] == mine["group"] and last["seq"] is not None and (
                    mine["seq"] is not None and last["seq"] >= mine["seq"]):
                continue  # it arrived
            if last is None:
                notes.append(f"rank {r} did not arrive (it has entered no collective yet)")
            else:
                label, _ = describe_group(last["group"], last["desc"])
                ago = max(0.0, answers[r]["now"] - last["since"])
                notes.append(f"rank {r} did not arrive (it last entered {last['op']} #{last['seq']} on process group "
                             f"{label}, {ago:.0f} s ago)")
        return "; ".join(notes) if notes else "every rank of the group arrived (the backend or the network failed)"
