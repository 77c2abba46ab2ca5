"""scripts/ds_unit_tests.py: how it obtains DeepSpeed's tests, selects files and reads results (no DeepSpeed run)."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ds_unit_tests.py"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("ds_unit_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _archive(path: Path, files: dict[str, str]) -> None:
    """A .tar.gz laid out as GitHub's archive of a commit: one top-level directory."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"DeepSpeed-abc123/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_obtains_only_tests_and_selects_files_that_initialize(runner, tmp_path):
    _archive(tmp_path / "ds.tar.gz", {
        "deepspeed/__init__.py": "x = 1",
        "tests/unit/common.py": "deepspeed.initialize(model=m)",
        "tests/unit/runtime/test_a.py": "engine, *_ = deepspeed.initialize(model=m, config=c)",
        "tests/unit/runtime/test_b.py": "def test(): pass",
        "tests/unit/runtime/helper.py": "deepspeed.initialize(model=m)",
    })
    tests = runner.obtain_tests(tmp_path / "work", "abc123", str(tmp_path / "ds.tar.gz"), None)
    assert tests == tmp_path / "work" / "abc123" / "tests"
    assert not (tmp_path / "work" / "abc123" / "deepspeed").exists()
    assert runner.select_files(tests) == ["unit/runtime/test_a.py"]


def test_a_failure_in_any_phase_is_the_tests_failure(runner, tmp_path):
    lines = [
        {"id": "t1", "when": "setup", "outcome": "passed", "reason": ""},
        {"id": "t1", "when": "call", "outcome": "passed", "reason": ""},
        {"id": "t1", "when": "teardown", "outcome": "failed", "reason": "boom"},
        {"id": "t2", "when": "setup", "outcome": "passed", "reason": ""},
        {"id": "t2", "when": "call", "outcome": "skipped", "reason": "no GPU"},
        {"id": "t3", "when": "call", "outcome": "passed", "reason": ""},
    ]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    assert runner._read_results(tmp_path) == {
        "t1": {"outcome": "failed", "reason": "teardown: boom"},
        "t2": {"outcome": "skipped", "reason": "no GPU"},
        "t3": {"outcome": "passed", "reason": ""},
    }


def _fail_like_pytest(x: int) -> int:
    if x == 2:
        pytest.fail("DID NOT RAISE <class 'AssertionError'>")
    return x


def test_a_pytest_outcome_in_a_pool_rank_fails_at_once_instead_of_hanging(tmp_path):
    """DeepSpeed's harness re-raises a rank's pytest.fail in a pool worker, which killed the worker
    and left the test waiting 660 s (the untested-optimizer tests under the shim)."""
    import multiprocessing
    import sys
    import time

    sys.path.insert(0, str(SCRIPT.parent))
    import ds_pool_guard

    ds_pool_guard.install()
    with multiprocessing.get_context("spawn").Pool(2, initializer=ds_pool_guard.install) as pool:
        start = time.monotonic()
        result = pool.starmap_async(_fail_like_pytest, [(1,), (2,)])
        with pytest.raises(RuntimeError, match="Failed: DID NOT RAISE"):
            result.get(60)
        assert time.monotonic() - start < 30
