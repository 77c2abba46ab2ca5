"""The planner's pass profiles computed on worker processes, ahead of their use, and kept on disk
between runs.

A search profiles a few hundred (chunk kind, blocks, micro-batch, tp, sequence parallelism,
checkpointing, attention, split backward) passes on fake tensors; for a 7B Llama on 64 GPUs that
was most of a minute one after another. `Profiler` runs them on a pool of forked worker processes
(one per core): those the search will most likely read start while it is still listing
candidates and computing bounds (``ahead``), and a pass it reads now goes before those. `ProfileStore`
(``zero3d plan``: under ``$ZERO3D_CACHE`` or ~/.cache/zero3d, ``plan-profiles/``) keeps each one
under a hash of everything it depends on: the model config, sequence length, dtype, the pass's
key, the torch and transformers versions and the source of the code that profiles. A profile is
deterministic, so a stored one is the one the run would compute.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import threading
import uuid
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ProfileKey = tuple  # (kind, blocks, micro_batch, tp, sequence_parallel, checkpointing, attention, split, whole_experts,
#                      cp, cp_method)
_SOURCES = ("parallel3d", "models", "zero")


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the Python source that profiles run (any change invalidates stored profiles)."""
    import torch
    import transformers

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for package in _SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


class ProfileStore:
    """Profiles on disk, one pickle per pass, named by the hash of what it depends on."""

    def __init__(self, directory: Path, config: Any, seq: int, dtype: Any) -> None:
        self.directory = directory
        self._prefix = json.dumps([config.to_json_string(use_diff=False), seq, str(dtype), code_version()])

    @classmethod
    def default(cls, config: Any, seq: int, dtype: Any) -> ProfileStore:
        from parallel3d.job.cache import cache_root

        return cls(cache_root() / "plan-profiles", config, seq, dtype)

    def _path(self, key: ProfileKey) -> Path:
        return self.directory / (hashlib.sha256((self._prefix + repr(key)).encode()).hexdigest()[:32] + ".pkl")

    def get(self, key: ProfileKey) -> Any:
        """The stored profile (or failure message, a str) of ``key``; None when not stored or unreadable."""
        try:
            return pickle.loads(self._path(key).read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            return None

    def put(self, key: ProfileKey, value: Any) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            tmp.write_bytes(pickle.dumps(value))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only cache costs time, not the plan
            logger.info("could not store a planner profile in %s: %s", self.directory, exc)


_JOB: dict = {}  # what a worker process profiles with (set by the pool's initializer)


def _start_worker(config: Any, seq: int, dtype: Any) -> None:
    _JOB.update(config=config, seq=seq, dtype=dtype)
    gc.freeze()  # what the worker inherited (modules, the model) is never garbage: its collections skip it


def _profile_group(keys: list[ProfileKey]) -> list[tuple[ProfileKey, Any]]:
    from parallel3d.planner.profile import profile_passes

    return list(profile_passes(_JOB["config"], keys, seq=_JOB["seq"], dtype=_JOB["dtype"]).items())


def _cost(keys: list[ProfileKey]) -> int:
    """A rough relative CPU cost of a group's passes, to start the longest first: proportional to
    blocks, and a split backward with recomputation recomputes the forward once per weight group."""
    return sum(key[1] * (4 if key[5] and key[7] and key[0] in ("middle", "last") else 1) for key in keys)


class Profiler:
    """Computes pass profiles, on ``workers`` forked processes when more than one.

    The keys that share a built model (``profile.model_key``) go to one worker together
    (``profile.profile_passes``), the costliest groups of a batch first. The pool is made at the
    first batch that can use it and kept until :meth:`close`: the search profiles in several
    batches, and a worker's first pass costs several times a later one's (fake-tensor dispatch
    caches warm up).

    :meth:`ahead` starts profiles in the background and returns: the search asks for the passes it
    will most likely read while it computes its bounds, so the workers are busy while it is.
    A call waits for its keys; those of its keys not sent to a worker yet go before everything
    queued ahead, so a profile made ahead never delays one that is read now. At most one group per
    worker is sent at a time (a pool's own queue could not be reordered)."""

    def __init__(self, config: Any, seq: int, dtype: Any, workers: int) -> None:
        self.config, self.seq, self.dtype, self.workers = config, seq, dtype, workers
        self._pool = None
        self._changed = threading.Condition()
        self._queued: list[list[ProfileKey]] = []  # groups not sent to a worker yet, the next first
        self._sent = 0  # groups at the workers
        self._pending: set[ProfileKey] = set()  # queued or sent
        self._results: dict[ProfileKey, Any] = {}  # done, not taken yet
        self._failure: BaseException | None = None

    @property
    def parallel(self) -> bool:
        return self.workers > 1 and "fork" in multiprocessing.get_all_start_methods()

    def ahead(self, keys: Iterable[ProfileKey]) -> None:
        """Start profiling ``keys`` on the workers, after what is queued, and return (no-op on one worker)."""
        if self.parallel:
            with self._changed:
                self._queue(keys, first=False)

    def started(self, keys: Iterable[ProfileKey]) -> bool:
        """Whether every one of ``keys`` is queued, at a worker or done (and not taken yet)."""
        with self._changed:
            return all(key in self._pending or key in self._results for key in keys)

    def __call__(self, keys: Iterable[ProfileKey], parallel: bool = True) -> dict[ProfileKey, Any]:
        """Each key's profile (or its ProfileError): those on the workers or queued for them waited
        for, the others computed on the workers (in this process where ``parallel`` is False or
        there is only one worker)."""
        from parallel3d.planner.profile import profile_passes

        keys = list(dict.fromkeys(keys))
        with self._changed:
            known = self._pending.union(self._results)
            here = [key for key in keys if key not in known and not (parallel and self.parallel)]
            self._queue([key for key in keys if key not in here], first=True)
        out = {key: value for group in _groups(here)
               for key, value in profile_passes(self.config, group, seq=self.seq, dtype=self.dtype).items()}
        with self._changed:
            while any(key not in self._results for key in keys if key not in out):
                if self._failure is not None:
                    raise RuntimeError("a planner profiling worker failed") from self._failure
                self._changed.wait()
            return out | {key: self._results.pop(key) for key in keys if key not in out}

    def _queue(self, keys: Iterable[ProfileKey], first: bool) -> None:
        """Queue the groups of ``keys`` not queued or done yet (``first``: before the others, with the
        queued groups that hold any of ``keys``), and send what the workers can take. Holds the lock."""
        keys = set(keys)
        if first:
            holding = [group for group in self._queued if keys.intersection(group)]
            self._queued = [group for group in self._queued if not keys.intersection(group)]
        else:
            holding = []
        new = _groups(key for key in keys if key not in self._pending and key not in self._results)
        self._pending.update(key for group in new for key in group)
        self._queued = [*new, *holding, *self._queued] if first else [*self._queued, *new]
        if self._queued and self._pool is None:
            self._pool = multiprocessing.get_context("fork").Pool(
                self.workers, initializer=_start_worker, initargs=(self.config, self.seq, self.dtype))
        while self._queued and self._sent < self.workers:
            self._sent += 1
            pool = self._pool
            pool.apply_async(_profile_group, (self._queued.pop(0),), callback=lambda done: self._done(pool, done),
                             error_callback=lambda exc: self._failed(pool, exc))

    def _done(self, pool, profiled: list[tuple[ProfileKey, Any]]) -> None:
        with self._changed:
            if pool is not self._pool:  # a pool closed since (its late results are not this profiler's)
                return
            self._sent -= 1
            for key, value in profiled:
                self._results[key] = value
                self._pending.discard(key)
            self._queue((), first=False)
            self._changed.notify_all()

    def _failed(self, pool, exc: BaseException) -> None:
        with self._changed:
            if pool is not self._pool:
                return
            self._failure = exc
            self._changed.notify_all()

    def close(self) -> dict[ProfileKey, Any]:
        """Stop the worker processes (a later call starts new ones); returns the profiles they made
        that were not taken (made ahead and not read), so they can be stored."""
        with self._changed:
            pool, self._pool = self._pool, None
            left, self._results = self._results, {}
            self._queued, self._sent, self._pending, self._failure = [], 0, set(), None
        if pool is not None:
            pool.terminate()
            pool.join()
        return left


def _groups(keys: Iterable[ProfileKey]) -> list[list[ProfileKey]]:
    """The keys grouped by the model they run on (``profile.model_key``), the costliest group first."""
    from parallel3d.planner.profile import model_key

    groups: dict[tuple, list[ProfileKey]] = {}
    for key in sorted(keys, key=repr):  # neighbours share most ops: the fake-tensor dispatch cache serves them
        groups.setdefault(model_key(key), []).append(key)
    return sorted(groups.values(), key=_cost, reverse=True)
