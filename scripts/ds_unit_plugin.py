"""pytest plugin for DeepSpeed's own unit tests, loaded by scripts/ds_unit_tests.py (``-p ds_unit_plugin``).

Environment (set by the runner):
  ZERO3D_DS_ENGINE   "deepspeed" (DeepSpeed itself, the baseline), "zero3d" (the shim), or
                     "fp16-probe" (fp16 reported unsupported and deepspeed.initialize refused:
                     a test that skips needs fp16 on the CPU, found without training anything)
  ZERO3D_DS_RECORD   a directory: ``results.jsonl`` gets one line per test phase,
                     ``collected.json`` the collected test ids, ``calls`` the test ids
                     during which ``deepspeed.initialize`` was called (by any process)

The shim (engine "zero3d") replaces DeepSpeed's public entry points by Zero3D's objects of
the same name, as a user's script would by changing its imports (``SHIMMED``):
``deepspeed.initialize``, ``deepspeed.zero.GatheredParameters``,
``deepspeed.utils.safe_{get,set}_full_*`` and the five LR schedule classes of
``deepspeed.runtime.lr_schedules``. Everything else a test touches stays DeepSpeed's.

DeepSpeed's test harness starts its ranks through a ``forkserver``. The plugin preloads
itself there, so every rank starts with torch, DeepSpeed (and Zero3D) imported and the shim
installed. It also stubs DeepSpeed's CPU shared-memory all-reduce op, which DeepSpeed would
otherwise JIT-compile with ninja in every fresh rank (tests/ds_oracle.py says why it is not
needed), and makes a rank's ``pytest.fail``-type outcome fail the test instead of hanging the
harness's pool (``ds_pool_guard``), a rank's ``pytest.xfail`` the test's xfail.

Two answers of DeepSpeed's CPU accelerator depend on the machine and decide which tests run
at all, so the plugin pins them (the subset in scripts/ds_unit_subset.json was measured so):
``is_fp16_supported()`` (oneDNN's fp16 kernels, a CPU with AVX512-FP16 or AMX: without them
test_fp16.py, test_dynamic_loss_scale.py, test_adamw.py, ... skip whole modules) is True, and
the number of CPU "devices" (NUMA nodes when numactl is installed, else 1; tests of a larger
world size skip) is the runner's ``LOCAL_SIZE`` (``--ranks``, 1 by default).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

ENGINE = os.environ.get("ZERO3D_DS_ENGINE", "deepspeed")
RECORD = Path(os.environ["ZERO3D_DS_RECORD"]) if os.environ.get("ZERO3D_DS_RECORD") else None

SHIMMED = {
    "deepspeed.initialize": "parallel3d.initialize",
    "deepspeed.zero.GatheredParameters": "parallel3d.GatheredParameters",
    **{f"deepspeed.utils.{name}": f"parallel3d.{name}" for name in (
        "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad", "safe_set_full_grad",
        "safe_get_full_optimizer_state", "safe_set_full_optimizer_state")},
    **{f"deepspeed.runtime.lr_schedules.{name}": f"parallel3d.lr.schedules.{name}" for name in (
        "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")},
    **{f"deepspeed.runtime.lr_schedules.{name}": f"parallel3d.lr.cycles.{name}" for name in (
        "OneCycle", "LRRangeTest")},
}
"""DeepSpeed's public name -> the Zero3D object that replaces it under the shim (same name)."""


def _resolve(dotted: str):
    """The object a dotted name reaches: attributes from the top package, importing submodules on the way."""
    import importlib

    parts = dotted.split(".")
    target = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        target = getattr(target, part) if hasattr(target, part) else importlib.import_module(".".join(parts[:i]))
    return target


def _record_call() -> None:
    """Note that the current test called deepspeed.initialize (the runner keeps only such tests)."""
    if RECORD is None:
        return
    current = RECORD / "current"
    test_id = current.read_text() if current.exists() else "?"
    with open(RECORD / "calls", "a") as f:
        f.write(test_id + "\n")


def _recording(initialize):
    def wrapper(*args, **kwargs):
        _record_call()
        return initialize(*args, **kwargs)

    wrapper.__wrapped__ = initialize
    return wrapper


def _pin_accelerator() -> None:
    """The CPU accelerator's machine-dependent answers that decide which tests run (module docstring)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    fp16 = ENGINE != "fp16-probe"
    CPU_Accelerator.is_fp16_supported = lambda self: fp16


def _refused(*args, **kwargs):
    raise RuntimeError("fp16 probe: the test reached deepspeed.initialize without fp16 (it does not need it)")


def _install() -> None:
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import ds_pool_guard

    ds_pool_guard.install()  # a failed outcome in a rank fails the test instead of hanging it
    _pin_accelerator()

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if ENGINE == "zero3d":
        for theirs, ours in SHIMMED.items():
            owner, _, name = theirs.rpartition(".")
            setattr(_resolve(owner), name, _resolve(ours))
    if ENGINE == "fp16-probe":
        deepspeed.initialize = _refused
    deepspeed.initialize = _recording(deepspeed.initialize)


_install()


def pytest_configure(config) -> None:
    import multiprocessing

    multiprocessing.set_forkserver_preload([__name__])
    if RECORD is not None:
        RECORD.mkdir(parents=True, exist_ok=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A rank's ``pytest.xfail`` (carried back by ds_pool_guard) is the test's xfail here."""
    import ds_pool_guard

    try:
        return (yield)
    except ds_pool_guard.RankXFailed as exc:
        pytest.xfail(str(exc.args[0]) if exc.args else "")


def pytest_collection_finish(session) -> None:
    if RECORD is not None:
        (RECORD / "collected.json").write_text(json.dumps([item.nodeid for item in session.items]))


def pytest_runtest_setup(item) -> None:
    if RECORD is not None:
        (RECORD / "current").write_text(item.nodeid)


_FRAME = re.compile(r'File "[^"]*/tests/(unit/[^"]+)", line (\d+), in \w+\n\s+(.+)')


def _raising_line(longrepr: str) -> str:
    """``unit/<file>:<line>: <code>`` of the innermost frame in DeepSpeed's tests (a rank's traceback
    comes back as text, and a bare ``assert`` there has no message: the line says what was checked)."""
    frames = _FRAME.findall(longrepr)
    if not frames:
        return ""
    file, line, code = frames[-1]
    return f"{file}:{line}: {code.strip()}"


def pytest_collectreport(report) -> None:
    """A module skipped as a whole (``pytest.skip(allow_module_level=True)``) is recorded under its own id."""
    if RECORD is not None and report.skipped:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        line = {"id": report.nodeid, "when": "collect", "outcome": "skipped", "reason": reason, "seconds": 0,
                "time": time.time()}
        with open(RECORD / "results.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_runtest_logreport(report) -> None:
    if RECORD is None:
        return
    reason, outcome = "", report.outcome
    if hasattr(report, "wasxfail"):  # an expected failure: "xfailed", or "xpassed" (not strict)
        reason, outcome = report.wasxfail, "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else str(report.longrepr)[-2000:]
        where = _raising_line(str(report.longrepr))
        if where:
            reason = f"{reason} [at {where}]"
    elif report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
    line = {"id": report.nodeid, "when": report.when, "outcome": outcome, "reason": reason,
            "seconds": round(report.duration, 2), "time": time.time()}
    with open(RECORD / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
