"""The planner's pass profiles computed ahead, in parallel, and kept on disk between runs.

A search profiles a few hundred (chunk kind, blocks, micro-batch, tp, sequence parallelism,
checkpointing, attention, split backward) passes on fake tensors, one after another when a
layout first needs them; for a 7B Llama on 64 GPUs that was most of a minute. ``prefetch``
computes every profile the search's first pass will read before it starts, on a pool of
worker processes (one per core), and `ProfileStore` (``zero3d plan``: under ``$ZERO3D_CACHE``
or ~/.cache/zero3d, ``plan-profiles/``) keeps each one under a hash of everything it depends on:
the model config, sequence length, dtype, the pass's key, the torch and transformers versions
and the source of the code that profiles. A profile is deterministic, so a stored one is the
one the run would compute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import pickle
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
    (``profile.profile_passes``), the costliest groups first. The pool is made at the first batch
    that can use it and kept until :meth:`close`: the search profiles in several batches, and a
    worker's first pass costs several times a later one's (fake-tensor dispatch caches warm up)."""

    def __init__(self, config: Any, seq: int, dtype: Any, workers: int) -> None:
        self.config, self.seq, self.dtype, self.workers = config, seq, dtype, workers
        self._pool = None

    def __call__(self, keys: Iterable[ProfileKey], parallel: bool = True) -> dict[ProfileKey, Any]:
        """Each key's profile (or its ProfileError)."""
        from parallel3d.planner.profile import model_key, profile_passes

        groups: dict[tuple, list[ProfileKey]] = {}
        for key in sorted(keys, key=repr):  # neighbours share most ops: the fake-tensor dispatch cache serves them
            groups.setdefault(model_key(key), []).append(key)
        work = sorted(groups.values(), key=_cost, reverse=True)
        if not parallel or self.workers <= 1 or len(work) < 2 or "fork" not in multiprocessing.get_all_start_methods():
            return {key: value for group in work
                    for key, value in profile_passes(self.config, group, seq=self.seq, dtype=self.dtype).items()}
        if self._pool is None:
            self._pool = multiprocessing.get_context("fork").Pool(
                self.workers, initializer=_start_worker, initargs=(self.config, self.seq, self.dtype))
        return {key: value for done in self._pool.imap_unordered(_profile_group, work) for key, value in done}

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
