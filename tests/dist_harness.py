"""Shared multi-process harness for distributed tests (CPU, gloo).

Why a pool: spawning a rank and importing torch/transformers costs seconds and CI has two
cores, so each world size gets one set of worker processes per pytest session, reused by
every test. A worker initialises the default process group once; tests send a module-level
function (pickled by reference) that runs on every rank inside that group.

Why kill on any failure: after an exception or a death on one rank, the others may sit in a
collective forever, and even if they return, the group's collective sequence may no longer
match. Killing the whole pool and respawning it lazily keeps one failing test from hanging
or poisoning the next. Worker stdout/stderr go to per-rank log files; the part written
during a failing call is appended to the error, so passing runs stay quiet.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
DEFAULT_TIMEOUT = float(os.environ.get("ZERO3D_TEST_TIMEOUT", "300"))
THREADS = int(os.environ.get("ZERO3D_TEST_THREADS", "1"))  # 4 ranks on 2 cores: no oversubscription
GRACE_S = 1.0  # after one rank fails, how long the others get to report before the pool dies
FULL_GC_EVERY = 50  # calls between two collections that also look at objects older than the last call
LOG_TAIL = 4000  # characters of a rank's output quoted in an error
# Imported once by multiprocessing's fork server, from which every rank is forked: a rank starts
# with them loaded instead of importing them (~3 s of CPU each). Importing runs no parallel op, so
# the server starts no OpenMP threads a fork could not take along.
PRELOAD = ["torch", "torch.distributed", "transformers", "tests.float64_loss"]


class DistTestError(AssertionError):
    """A distributed call failed on some rank, timed out, or a rank died."""


def _worker_main(rank: int, world: int, port: int, conn: Any, log_path: str) -> None:
    """Rank process: set up env, logging and the process group, then serve calls forever."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
    )
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults leave a stack in the log
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # timeout dumps

    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    torch.set_num_threads(THREADS)
    from tests.float64_loss import install

    install()  # float64 oracles compute their loss in float64 (tests/float64_loss.py)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=DEFAULT_TIMEOUT + 60))
    conn.send(("ready", os.getpid()))
    calls = 0
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not payload:  # shutdown request
            break
        groups_before = set(c10d._world.pg_map)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply: tuple = ("ok", fn(*args, **kwargs))
            # Sub-groups (DeviceMesh dims) are per call: gloo groups hold threads and sockets,
            # and hundreds of tests would pile them up. Tests must not cache groups.
            for pg in set(c10d._world.pg_map) - groups_before:
                dist.destroy_process_group(pg)
        except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
            reply = ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        calls += 1
        _collect_garbage(full=calls % FULL_GC_EVERY == 0)
        sys.stdout.flush()
        sys.stderr.flush()
        try:  # plain pickle: tensors travel by value, not through torch's shared-memory reducers
            data = pickle.dumps(reply)
        except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
            data = pickle.dumps(("err", "result could not be pickled", traceback.format_exc()))
        conn.send_bytes(data)
        if not dist.is_initialized():  # fn destroyed the default group: exit, respawn on next use
            break
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown of torch: ~1 s per rank on a busy 2-core box


def _collect_garbage(full: bool) -> None:
    """Free the cyclic garbage a call left, at the same point on every rank (a finalizer may run a
    collective or end a thread), then freeze what survives: the next collection looks only at what
    later calls allocate. A full collection of everything (~0.15 s a rank once torch, transformers
    and DeepSpeed are imported, against milliseconds) runs every ``FULL_GC_EVERY`` calls, for what
    was alive after one call and became garbage later."""
    if full:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


class Pool:
    """`world` rank processes (forked from multiprocessing's fork server) sharing one default gloo process group."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.logs: list[Path] = []
        self._store: Any = None  # the TCPStore server lives here: no free-port race

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def start(self, timeout: float = 120.0) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        logdir = Path(tempfile.mkdtemp(prefix=f"zero3d-dist{self.world}-"))
        self.logs = [logdir / f"rank{r}.log" for r in range(self.world)]
        ctx = get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"zero3d-rank{rank}", daemon=True,
                               args=(rank, self.world, self._store.port, child, str(self.logs[rank])))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.conns):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    conn.recv()
                    continue
            except (EOFError, OSError):
                pass
            self.procs[rank].join(0.5)
            why = f"failed to start (exit code {self.procs[rank].exitcode})\n{self._tail(rank, 0)}"
            self.kill()
            raise DistTestError(f"world {self.world}: rank {rank} {why}")

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        """Run fn on every rank; return per-rank results or raise DistTestError (pool killed)."""
        payload = pickle.dumps((fn, args, kwargs))  # fails here, not in a worker, if unpicklable
        if not self.alive:
            self.kill()
            self.start()
        offsets = [log.stat().st_size for log in self.logs]
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
            results, errors, deaths, pending = self._collect(timeout)
        except BaseException:  # e.g. KeyboardInterrupt or pytest-timeout: state unknown
            self.kill()
            raise
        name = f"{fn.__module__}.{fn.__qualname__}"
        if not errors and not deaths and not pending:
            return [results[r] for r in range(self.world)]
        if errors or deaths:
            parts = [f"{name} failed in world {self.world}"]
            for rank, (msg, tb) in sorted(errors.items()):
                parts.append(f"--- rank {rank} raised {msg}\n{tb}{self._tail(rank, offsets[rank])}")
            for rank, code in sorted(deaths.items()):
                sig = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
                parts.append(f"--- rank {rank} died with exit code {code}{sig}\n{self._tail(rank, offsets[rank])}")
            if pending:
                parts.append(f"--- ranks {sorted(pending)} had not finished (killed)")
        else:
            for rank in pending:  # faulthandler dumps every thread's stack into the rank log
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            time.sleep(0.3)
            parts = [f"{name} timed out after {timeout:g} s in world {self.world}; "
                     f"ranks {sorted(pending)} had not finished"]
            parts += [f"--- rank {r} output and stack:\n{self._tail(r, offsets[r])}" for r in sorted(pending)]
        self.kill()
        raise DistTestError("\n".join(parts))

    def _collect(self, timeout: float) -> tuple[dict, dict, dict, set]:
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        deaths: dict[int, int | None] = {}
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout
        failed = False
        while pending:
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            ready = connection.wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in sorted({waitables[w] for w in ready}):
                conn = self.conns[rank]
                try:
                    reply = pickle.loads(conn.recv_bytes()) if conn.poll() else None
                except (EOFError, OSError):
                    reply = None
                if reply is None:  # the sentinel fired with nothing to read: the rank died
                    self.procs[rank].join(1.0)
                    deaths[rank] = self.procs[rank].exitcode
                elif reply[0] == "ok":
                    results[rank] = reply[1]
                else:
                    errors[rank] = (reply[1], reply[2])
                pending.discard(rank)
                if (errors or deaths) and not failed:
                    failed, deadline = True, min(deadline, time.monotonic() + GRACE_S)
        return results, errors, deaths, pending

    def _tail(self, rank: int, offset: int) -> str:
        try:
            with open(self.logs[rank], "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        text = text[-LOG_TAIL:]
        return f"[rank {rank} output]\n{text}" if text.strip() else ""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask workers to exit cleanly; kill whatever does not."""
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        if self.logs:
            shutil.rmtree(self.logs[0].parent, ignore_errors=True)
        self.procs, self.conns, self.logs, self._store = [], [], [], None


class DistRunner:
    """What the `dist` fixture yields: one lazily started Pool per world size."""

    def __init__(self) -> None:
        self.pools: dict[int, Pool] = {}

    def pool(self, world: int) -> Pool:
        return self.pools.setdefault(world, Pool(world))

    def run(self, world: int, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on each rank of the `world`-process pool; results by rank."""
        return self.pool(world).run(fn, args, kwargs, DEFAULT_TIMEOUT if timeout is None else timeout)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()
        self.pools.clear()
