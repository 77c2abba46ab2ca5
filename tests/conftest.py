"""Session fixtures shared by all tests."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:  # so `tests.*` and the packages import without installing
    sys.path.insert(0, _ROOT)

from tests.dist_harness import DistRunner  # noqa: E402
from tests.float64_loss import install as _install_float64_loss  # noqa: E402

_install_float64_loss()

if "ZERO3D_CACHE" not in os.environ:  # the suite neither reads nor fills the user's cache: it starts cold, as on CI
    os.environ["ZERO3D_CACHE"] = tempfile.mkdtemp(prefix="zero3d-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ZERO3D_CACHE"], True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive (torch, transformers, the test modules: ~400k objects), so
    the full collections Python runs during the tests do not walk them each time; they are never
    garbage before the session ends. (The ranks of tests/dist_harness.py freeze after each call.)"""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def dist() -> Iterator[DistRunner]:
    """Multi-process runner: `dist.run(world, fn, *args, **kw)` -> list of results by rank.

    Worker pools are started on first use of each world size and reused for the session.
    """
    runner = DistRunner()
    yield runner
    runner.shutdown()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The ZERO3D_CACHE of the job tests' runs: one for the session, so the tokenizer and packed data
    of the tiny job (cached by content) are built once, not once per module (seconds each).
    Building them cold is tested by tests/test_job_data.py, on caches of its own."""
    return tmp_path_factory.mktemp("zero3d-cache")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, cache_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny job trained once by `zero3d train` on 2 processes (12 steps; checkpoints at steps 8
    and 12): its run directory and the finished launcher. For the tests that only read the run
    (its files, or its latest checkpoint exported elsewhere): each own run costs a launch (seconds)."""
    from tests.test_train_cli import train_two_processes

    return train_two_processes(tmp_path_factory.mktemp("tiny-run"), cache_dir)
