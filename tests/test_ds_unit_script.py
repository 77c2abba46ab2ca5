"""scripts/ds_unit_tests.py: how it obtains DeepSpeed's tests, selects files and reads results (no DeepSpeed run)."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
import time
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


def _xfail_like_pytest(x: int) -> int:
    if x == 2:
        pytest.xfail("a known limit of this rank")
    return x


def _guard():
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import ds_pool_guard

    return ds_pool_guard


def test_a_pytest_xfail_in_a_pool_rank_comes_back_as_an_xfail_not_a_failure():
    """The guard used to turn a rank's pytest.xfail into a RuntimeError (the test failed)."""
    import multiprocessing
    import time

    ds_pool_guard = _guard()
    with multiprocessing.get_context("spawn").Pool(2, initializer=ds_pool_guard.install) as pool:
        start = time.monotonic()
        result = pool.starmap_async(_xfail_like_pytest, [(1,), (2,)])
        with pytest.raises(ds_pool_guard.RankXFailed, match="a known limit of this rank"):
            result.get(60)
        assert time.monotonic() - start < 30


def test_the_plugin_turns_a_carried_xfail_into_the_tests_xfail(tmp_path):
    """End to end through the plugin: the test reports xfailed (recorded so), a plain failure failed."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_x.py").write_text(
        "import ds_pool_guard\n"
        "def test_carried():\n    raise ds_pool_guard.RankXFailed('rank 1: not yet')\n"
        "def test_failed():\n    raise RuntimeError('Failed: DID NOT RAISE')\n")
    record = tmp_path / "record"
    env = dict(os.environ, ZERO3D_DS_ENGINE="deepspeed", ZERO3D_DS_RECORD=str(record), DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(SCRIPT.parent), str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ds_unit_plugin",
                    str(tmp_path / "test_x.py")], cwd=tmp_path, env=env, capture_output=True, timeout=300)
    calls = [json.loads(line) for line in (record / "results.jsonl").read_text().splitlines()]
    outcome = {c["id"].split("::")[1]: (c["outcome"], c["reason"]) for c in calls if c["when"] == "call"}
    assert outcome == {"test_carried": ("xfailed", "rank 1: not yet"),
                       "test_failed": ("failed", "RuntimeError: Failed: DID NOT RAISE")}


def test_the_subset_is_pinned_per_file_and_a_file_without_an_entry_stops(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "environment", lambda: {"deepspeed": "x"})
    path = tmp_path / "subset.json"
    runner.pin_subset(path, "rev1", 1, {"unit/b.py": ["unit/b.py::t"], "unit/a.py": []})
    runner.pin_subset(path, "rev1", 1, {"unit/c.py": ["unit/c.py::u"]})
    pinned = json.loads(path.read_text())
    assert list(pinned["files"]) == ["unit/a.py", "unit/b.py", "unit/c.py"]
    assert runner.load_pinned(path, "rev1", 1, ["unit/c.py", "unit/a.py"]) == {"unit/c.py": ["unit/c.py::u"],
                                                                              "unit/a.py": []}
    with pytest.raises(SystemExit, match="no pinned subset for 1 file.*unit/d.py"):
        runner.load_pinned(path, "rev1", 1, ["unit/a.py", "unit/d.py"])
    with pytest.raises(SystemExit, match="--ranks 1, not rev1 with --ranks 2"):
        runner.load_pinned(path, "rev1", 2, ["unit/a.py"])
    runner.pin_subset(path, "rev2", 1, {"unit/a.py": ["unit/a.py::v"]})  # another revision starts afresh
    assert json.loads(path.read_text())["files"] == {"unit/a.py": ["unit/a.py::v"]}


def test_the_committed_subset_is_one_list_of_ids_per_file(runner):
    pinned = json.loads(runner.SUBSET_FILE.read_text())
    assert pinned["rev"] == runner.PINNED_REV and pinned["ranks"] == 1
    for file, ids in pinned["files"].items():
        assert file.startswith("unit/") and file.endswith(".py")
        assert ids == sorted(set(ids)) and all(t.startswith(file + "::") for t in ids)


def test_the_report_counts_each_file_and_classifies_every_failure(tmp_path):
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import ds_unit_report

    rule = ds_unit_report.Rule(ds_unit_report.INTERNAL, r"has no attribute 'bit16_groups'", "DeepSpeed's buffers")
    report = {
        "unit/a.py": {"unit/a.py::t1": {"outcome": "passed", "reason": ""},
                      "unit/a.py::t2": {"outcome": "failed", "reason": "call: AttributeError: x has no attribute "
                                                                       "'bit16_groups'", "commit": "abc1234"},
                      "unit/a.py::t3": {"outcome": "failed", "reason": "call: AssertionError: 1 != 2"},
                      "unit/a.py::t4": {"outcome": "not run", "reason": ""}},
        "unit/b.py": {},
    }
    original = ds_unit_report.RULES
    ds_unit_report.RULES = (rule,)
    try:
        text = ds_unit_report.markdown(report, "0123456789", {"deepspeed": "0.19.8"})
        docs = tmp_path / "d.md"
        docs.write_text(f"intro\n{ds_unit_report.BEGIN}\nold\n{ds_unit_report.END}\nrest\n")
        ds_unit_report.write_docs(docs, report, "0123456789", {"deepspeed": "0.19.8"})
    finally:
        ds_unit_report.RULES = original
    assert "**1 of 4 pass**; failed: 1 DeepSpeed internal, 0 not supported, 0 wrong behaviour, 1 unclassified; " \
           "not run yet: 1." in text
    assert "| `unit/a.py` | 4 | 1 | 1 | 0 | 0 | 1 | 1 |" in text
    assert "**DeepSpeed internal** (1): DeepSpeed's buffers. Tests: `t2`." in text
    assert "**unclassified** (1): call: AssertionError: 1 != 2. Tests: `t3`." in text
    assert "no test in the subset (1): `unit/b.py`" in text
    written = docs.read_text()
    assert written.startswith("intro\n") and written.endswith(f"{ds_unit_report.END}\nrest\n") and "old" not in written
    with pytest.raises(SystemExit, match="markers"):
        ds_unit_report.write_docs(_plain(tmp_path), report, "r", {})


def _plain(tmp_path: Path) -> Path:
    path = tmp_path / "plain.md"
    path.write_text("no markers\n")
    return path


_FAKE_BUILDER = """
import os, time
from pathlib import Path

from torch.utils.file_baton import FileBaton


class _Builder:
    NAME = "slow_op"

    def load(self, verbose=False):  # as torch's _jit_compile: take the lock and build, or wait while another holds it
        if "FAKE_GO" in os.environ:  # say it has started, and try the lock only when told
            Path(os.environ["FAKE_READY"]).touch()
            while not Path(os.environ["FAKE_GO"]).exists():
                time.sleep(0.02)
        baton = FileBaton(str(Path(os.environ["TORCH_EXTENSIONS_DIR"]) / self.NAME / "lock"))
        if not baton.try_acquire():
            baton.wait()
            return
        try:
            if os.environ.get("FAKE_BUILD") == "fail":
                raise RuntimeError("no compiler")
            stop = Path(os.environ.get("FAKE_BUILD_UNTIL", "/nonexistent"))
            deadline = time.monotonic() + 120
            while not stop.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            baton.release()


class _Accelerator:
    def create_op_builder(self, name):
        return _Builder()


def get_accelerator():
    return _Accelerator()
"""

_FAKE_BATON = """
import os, time


class FileBaton:  # torch.utils.file_baton's protocol: the lock file is created with O_EXCL, removed on release
    def __init__(self, lock_file_path):
        self.lock_file_path = lock_file_path

    def try_acquire(self):
        try:
            os.close(os.open(self.lock_file_path, os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def wait(self):
        while os.path.exists(self.lock_file_path):
            time.sleep(0.05)

    def release(self):
        os.remove(self.lock_file_path)
"""


def _wait_for(path: Path, run) -> None:
    """Until ``path`` exists (or the build ``run`` has ended)."""
    while not path.exists() and not run.done():
        time.sleep(0.02)


def test_an_op_build_has_its_own_timeout_and_removes_only_its_own_lock(tmp_path):
    """scripts/ds_unit_ops.py builds DeepSpeed's ops before the tests; a build that overruns its timeout is
    killed, and the lock file it held removed (left there, every later load of the op would wait for it for
    ever). Two runs building the same op at once: the one killed while waiting for the other's lock leaves it
    alone. Fake ``deepspeed.accelerator`` and ``torch.utils`` modules stand in: no compiler runs."""
    import os
    import sys
    from concurrent.futures import ThreadPoolExecutor

    sys.path.insert(0, str(SCRIPT.parent))
    import ds_unit_ops

    fakes = tmp_path / "fakes"
    (fakes / "deepspeed").mkdir(parents=True)
    (fakes / "torch" / "utils").mkdir(parents=True)
    for package in ("deepspeed", "torch", "torch/utils"):
        (fakes / package / "__init__.py").write_text("")
    (fakes / "deepspeed" / "accelerator.py").write_text(_FAKE_BUILDER)
    (fakes / "torch" / "utils" / "file_baton.py").write_text(_FAKE_BATON)
    (fakes / "torch" / "utils" / "cpp_extension.py").write_text(
        "import os\ndef _get_build_directory(name, verbose):\n"
        "    path = os.path.join(os.environ['TORCH_EXTENSIONS_DIR'], name)\n    os.makedirs(path, exist_ok=True)\n"
        "    return path\n")
    extensions = tmp_path / "extensions"
    env = dict(os.environ, PYTHONPATH=str(fakes), TORCH_EXTENSIONS_DIR=str(extensions))
    lock, stop = extensions / "slow_op" / "lock", tmp_path / "stop"

    ready, go = tmp_path / "ready", tmp_path / "go"
    with ThreadPoolExecutor(2) as pool:
        # the second run's child starts while the lock is free, the first run then takes it and builds until told
        # to stop, and the second tries the lock, waits for it, and is killed by its timeout
        second = pool.submit(ds_unit_ops.build_op, "SlowBuilder", 3, dict(env, FAKE_READY=str(ready), FAKE_GO=str(go)))
        _wait_for(ready, second)
        first = pool.submit(ds_unit_ops.build_op, "SlowBuilder", 60, dict(env, FAKE_BUILD_UNTIL=str(stop)))
        _wait_for(lock, first)
        go.touch()
        ok, seconds, what = second.result()
        assert not ok and seconds < 60 and lock.exists(), (seconds, what)
        assert what.startswith(f"not built within 3 s (killed); {lock} is not this build's (it was waiting for "
                               "it): if no other process is building the op, remove it"), what
        stop.touch()
        assert first.result()[::2] == (True, "built or loaded from the cache")
    assert not lock.exists()  # released by its owner

    ok, _, what = ds_unit_ops.build_op("SlowBuilder", 3, env)
    assert not ok and what == f"not built within 3 s (killed); removed the lock file it held, {lock}", what
    assert not lock.exists()

    ok, _, what = ds_unit_ops.build_op("SlowBuilder", 60, dict(env, FAKE_BUILD="fail"))
    assert not ok and what.startswith("failed (exit code 1):") and "RuntimeError: no compiler" in what, what
    assert "ds_unit_ops:" not in what and not lock.exists()
