"""Run DeepSpeed's own unit tests against Zero3D through a shim; report passes per file.

    python scripts/ds_unit_tests.py                       # fetch, baseline, shim run, report
    python scripts/ds_unit_tests.py --git-dir ~/DeepSpeed/.git --rev v0.19.8
    python scripts/ds_unit_tests.py --files unit/runtime/test_ds_initialize.py -k Optimizer

1. Obtain DeepSpeed's ``tests/`` at a pinned revision, never vendored: from GitHub's archive
   of that revision (``--archive`` may name another URL or a local .tar.gz), or from a local
   git clone (``--git-dir``). The PyPI sdist of deepspeed holds no tests.
2. Select the test files that call ``deepspeed.initialize``.
3. Baseline: run them with DeepSpeed itself on CPU (``DS_ACCELERATOR=cpu``), once per
   revision (cached in the work directory). The subset is every test that passes there *and*
   called ``deepspeed.initialize`` while it ran.
4. Run that subset with the shim (scripts/ds_unit_plugin.py), which maps DeepSpeed's public
   entry points to Zero3D's, and report each file's pass count and every failure's reason.

Each file runs in its own pytest process (DeepSpeed's harness ends the whole session when a
test hangs); a file whose session ended early is resumed without the tests already done.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

logger = logging.getLogger("ds_unit_tests")

REPO_ROOT = Path(__file__).resolve().parent.parent
PINNED_REV = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
"""DeepSpeed commit whose tests are run (master after v0.19.5, the newest the project could
read when this was written; the installed deepspeed package is the baseline's engine)."""
ARCHIVE_URL = "https://codeload.github.com/deepspeedai/DeepSpeed/tar.gz/{rev}"
HELPERS = ("common.py", "util.py", "simple_model.py", "alexnet_model.py", "autoep_test_utils.py")


def obtain_tests(work: Path, rev: str, archive: str | None, git_dir: str | None) -> Path:
    """DeepSpeed's ``tests`` directory at ``rev``, extracted under ``work`` (reused if present)."""
    target = work / rev
    tests = target / "tests"
    if (tests / "unit").is_dir():
        return tests
    target.mkdir(parents=True, exist_ok=True)
    if git_dir:
        data = subprocess.run(["git", "--git-dir", git_dir, "archive", "--format=tar", rev, "tests"],
                              check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(target, filter="data")
        return tests
    source = archive or ARCHIVE_URL.format(rev=rev)
    logger.info("downloading DeepSpeed's tests from %s", source)
    if "://" in source:
        with urllib.request.urlopen(source, timeout=300) as response:
            data = response.read()
    else:
        data = Path(source).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/", 1)  # GitHub archives have one top-level directory
            if len(parts) == 2 and parts[1].startswith("tests/"):
                member.name = parts[1]
                members.append(member)
        tar.extractall(target, members=members, filter="data")
    return tests


def select_files(tests: Path) -> list[str]:
    """Test files (relative to ``tests``) whose text calls deepspeed.initialize."""
    files = []
    for path in sorted((tests / "unit").rglob("test_*.py")):
        if path.name not in HELPERS and "deepspeed.initialize" in path.read_text(errors="replace"):
            files.append(str(path.relative_to(tests)))
    return files


def _read_results(record: Path) -> dict[str, dict]:
    """Test id -> {"outcome", "reason"}: a failure in any phase is the test's failure."""
    results: dict[str, dict] = {}
    path = record / "results.jsonl"
    if not path.exists():
        return results
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        test = results.setdefault(entry["id"], {"outcome": "passed", "reason": ""})
        if entry["outcome"] == "failed" and test["outcome"] != "failed":
            test.update(outcome="failed", reason=f"{entry['when']}: {entry['reason']}")
        elif entry["outcome"] == "skipped" and test["outcome"] == "passed":
            test.update(outcome="skipped", reason=entry["reason"])
    return results


def run_file(tests: Path, file: str, engine: str, record: Path, only: list[str] | None, extra: list[str],
             timeout: int) -> dict[str, dict]:
    """Run one test file (or the ``only`` ids of it) under ``engine``; every test id -> result."""
    record.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, ZERO3D_DS_ENGINE=engine, ZERO3D_DS_RECORD=str(record), DS_ACCELERATOR="cpu",
               DS_UNITTEST_TIMEOUT=str(timeout), PYTHONPATH=os.pathsep.join(
                   [str(REPO_ROOT / "scripts"), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done: dict[str, dict] = {}
    for _ in range(20):  # resume after a session that ended early, without the tests already done
        targets = [t for t in only if t not in done] if only is not None else [file]
        if not targets:
            break
        args_file = record / "args.txt"
        args_file.write_text("\n".join(targets + [f"--deselect={t}" for t in done]))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ds_unit_plugin",
               f"--timeout={timeout + 60}", f"@{args_file}", *extra]
        with open(record / "pytest.log", "a") as log:
            subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=None)
        before = len(done)
        done = _read_results(record)
        collected = json.loads((record / "collected.json").read_text()) if (record / "collected.json").exists() else []
        if only is None:
            only = collected
        if len(done) == before or all(t in done for t in only):
            break
    log_lines = (record / "pytest.log").read_text(errors="replace").strip().splitlines() or [""]
    for test in only or []:
        done.setdefault(test, {"outcome": "failed",
                               "reason": f"not run: the pytest session ended before it ({log_lines[-1][:300]})"})
    return {t: r for t, r in done.items() if only is None or t in only}


def calls(record: Path) -> set[str]:
    path = record / "calls"
    return set(path.read_text().split("\n")) - {""} if path.exists() else set()


def baseline(tests: Path, files: list[str], work: Path, timeout: int, extra: list[str]) -> dict[str, list[str]]:
    """File -> ids of the tests that pass with DeepSpeed and call deepspeed.initialize (cached)."""
    cache = work / "baseline.json"
    subset: dict[str, list[str]] = json.loads(cache.read_text()) if cache.exists() else {}
    for file in files:
        if file in subset:
            continue
        record = work / "deepspeed" / file.replace("/", "__")
        shutil.rmtree(record, ignore_errors=True)
        results = run_file(tests, file, "deepspeed", record, None, extra, timeout)
        called = calls(record)
        subset[file] = sorted(t for t, r in results.items() if r["outcome"] == "passed" and t in called)
        logger.info("baseline %s: %d of %d tests pass with DeepSpeed and call deepspeed.initialize",
                    file, len(subset[file]), len(results))
        cache.write_text(json.dumps(subset, indent=1))
    return {f: subset[f] for f in files}


def shim_run(tests: Path, subset: dict[str, list[str]], work: Path, timeout: int, extra: list[str]) -> dict:
    report = {}
    for file, ids in subset.items():
        if not ids:
            continue
        record = work / "zero3d" / file.replace("/", "__")
        shutil.rmtree(record, ignore_errors=True)
        results = run_file(tests, file, "zero3d", record, ids, extra, timeout)
        report[file] = {t: results[t] for t in ids}
        passed = sum(r["outcome"] == "passed" for r in report[file].values())
        logger.info("zero3d %s: %d of %d pass", file, passed, len(ids))
    return report


def print_report(report: dict, out) -> None:
    total = sum(len(r) for r in report.values())
    passed = sum(r["outcome"] == "passed" for rs in report.values() for r in rs.values())
    print(f"DeepSpeed unit tests through Zero3D: {passed} of {total} pass", file=out)
    print("\nper file (passed / subset):", file=out)
    for file, results in report.items():
        ok = sum(r["outcome"] == "passed" for r in results.values())
        print(f"  {ok:4d} / {len(results):<4d} {file}", file=out)
    print("\nfailures:", file=out)
    reasons = collections.Counter()
    for results in report.values():
        for test, r in results.items():
            if r["outcome"] != "passed":
                reason = " ".join(r["reason"].split())[:300]
                reasons[reason] += 1
                print(f"  {test}\n      {r['outcome']}: {reason}", file=out)
    print("\nfailure reasons by count:", file=out)
    for reason, count in reasons.most_common():
        print(f"  {count:4d}  {reason}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=PINNED_REV, help="DeepSpeed revision whose tests to run")
    parser.add_argument("--archive", help="URL or path of a .tar.gz of the DeepSpeed repository at --rev")
    parser.add_argument("--git-dir", help="a local DeepSpeed git directory to take --rev from")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "zero3d" / "ds-unit-tests"),
                        help="where tests, baselines and results are kept")
    parser.add_argument("--files", nargs="*", help="only these test files (relative to tests/)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one test may take")
    parser.add_argument("--ranks", type=int, default=0,
                        help="CPU 'devices' DeepSpeed's harness may use (its LOCAL_SIZE): by default it counts NUMA "
                             "nodes and skips tests of larger world sizes; 2 or 4 runs those too (slower)")
    parser.add_argument("--baseline-only", action="store_true", help="stop after the DeepSpeed baseline")
    parser.add_argument("--report", help="also write the results as JSON here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(opts.work).expanduser() / opts.rev / (f"ranks{opts.ranks}" if opts.ranks else "")
    if opts.ranks:
        os.environ["LOCAL_SIZE"] = str(opts.ranks)
    tests = obtain_tests(Path(opts.work).expanduser(), opts.rev, opts.archive, opts.git_dir)
    files = opts.files or select_files(tests)
    subset = baseline(tests, files, work, opts.timeout, opts.pytest_args)
    if opts.baseline_only:
        print(f"baseline: {sum(map(len, subset.values()))} tests in {len(files)} files pass with DeepSpeed "
              "and call deepspeed.initialize")
        return 0
    report = shim_run(tests, subset, work, opts.timeout, opts.pytest_args)
    print_report(report, sys.stdout)
    if opts.report:
        Path(opts.report).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
