"""Run DeepSpeed's own unit tests against Zero3D through a shim; report passes per file.

    python scripts/ds_unit_tests.py --git-dir ~/DeepSpeed/.git            # the pinned subset, all files
    python scripts/ds_unit_tests.py --files unit/runtime/test_ds_initialize.py --match Optimizer
    python scripts/ds_unit_tests.py --no-run --docs docs/deepspeed.md     # report of the stored results
    python scripts/ds_unit_tests.py --rebaseline --baseline-only --files ...   # re-measure, re-pin

1. Obtain DeepSpeed's ``tests/`` at a pinned revision, never vendored: from GitHub's archive
   of that revision (``--archive`` may name another URL or a local .tar.gz), or from a local
   git clone (``--git-dir``). The PyPI sdist of deepspeed holds no tests.
2. Select the test files that call ``deepspeed.initialize``.
3. The subset: every test that passes with DeepSpeed itself on CPU (``DS_ACCELERATOR=cpu``)
   *and* called ``deepspeed.initialize`` while it ran. It is pinned in
   scripts/ds_unit_subset.json, so every machine runs the same tests: which tests DeepSpeed
   passes depends on the machine (a CPU without fp16 kernels skips the fp16 modules, numactl
   with several NUMA nodes runs the tests of world size 2, the JIT ops need a compiler, a slow
   machine times out). ``--rebaseline`` measures files anew with DeepSpeed and re-pins them.
4. Run that subset with the shim (scripts/ds_unit_plugin.py), which maps DeepSpeed's public
   entry points to Zero3D's, and report each file's pass count and every failure's reason and
   class (scripts/ds_unit_report.py); ``--docs`` writes that report into docs/deepspeed.md.

Before any test runs, DeepSpeed's JIT ops that the subset loads are built, each under its own
timeout (scripts/ds_unit_ops.py): built inside the first test that loads it, an op's build
counted against that test's timeout, so the count depended on the machine's load.

Each file runs in its own pytest process (DeepSpeed's harness ends the whole session when a
test hangs); a file whose session ended early is resumed without the tests already done.
Results are stored per test in the work directory, so files can be run one at a time and the
report assembled from them (``--no-run``).
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_unit_ops  # noqa: E402
import ds_unit_report  # noqa: E402

logger = logging.getLogger("ds_unit_tests")

REPO_ROOT = Path(__file__).resolve().parent.parent
PINNED_REV = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
"""DeepSpeed commit whose tests are run (master after v0.19.5, the newest the project could
read when this was written; the installed deepspeed package is the baseline's engine)."""
ARCHIVE_URL = "https://codeload.github.com/deepspeedai/DeepSpeed/tar.gz/{rev}"
SUBSET_FILE = Path(__file__).resolve().with_name("ds_unit_subset.json")
"""The pinned subset: per selected file, the ids of the tests that passed with DeepSpeed itself and
called deepspeed.initialize when it was measured (``--rebaseline``), so every machine runs the same."""
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
        elif entry["outcome"] in ("skipped", "xfailed", "xpassed") and test["outcome"] == "passed":
            test.update(outcome=entry["outcome"], reason=entry["reason"])
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


def baseline(tests: Path, files: list[str], work: Path, timeout: int) -> dict[str, list[str]]:
    """File -> ids of the tests that pass with DeepSpeed and call deepspeed.initialize (cached).

    Always whole files (no extra pytest arguments): a cached entry stands for the whole file.
    """
    cache = work / "baseline.json"
    subset: dict[str, list[str]] = json.loads(cache.read_text()) if cache.exists() else {}
    for file in files:
        if file in subset:
            continue
        record = work / "deepspeed" / file.replace("/", "__")
        shutil.rmtree(record, ignore_errors=True)
        results = run_file(tests, file, "deepspeed", record, None, [], timeout)
        called = calls(record)
        subset[file] = sorted(t for t, r in results.items() if r["outcome"] == "passed" and t in called)
        logger.info("baseline %s: %d of %d tests pass with DeepSpeed and call deepspeed.initialize",
                    file, len(subset[file]), len(results))
        cache.write_text(json.dumps(subset, indent=1))
    return {f: subset[f] for f in files}


def environment() -> dict[str, str]:
    """The versions a baseline was measured with (recorded beside the pinned subset)."""
    from importlib.metadata import version

    import torch

    return {"deepspeed": version("deepspeed"), "torch": version("torch"), "pytest": version("pytest"),
            "python": ".".join(map(str, sys.version_info[:3])),
            "cpu_fp16": str(bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()))}


def pin_subset(path: Path, rev: str, ranks: int, subset: dict[str, list[str]]) -> None:
    """Write ``subset`` (file -> ids, every file measured, [] where none qualifies) into the pinned file."""
    pinned = json.loads(path.read_text()) if path.exists() else {}
    if pinned.get("rev") != rev or pinned.get("ranks") != ranks:
        pinned = {"rev": rev, "ranks": ranks, "files": {}}
    pinned["measured_with"] = environment()
    pinned["files"] = dict(sorted({**pinned["files"], **subset}.items()))
    path.write_text(json.dumps(pinned, indent=1) + "\n")


def load_pinned(path: Path, rev: str, ranks: int, files: list[str]) -> dict[str, list[str]]:
    """The pinned subset of ``files``; a file without an entry stops with the command that measures it."""
    pinned = json.loads(path.read_text()) if path.exists() else {"files": {}}
    if pinned.get("rev") != rev or pinned.get("ranks") != ranks:
        raise SystemExit(f"{path} pins the subset of DeepSpeed {pinned.get('rev')} with --ranks "
                         f"{pinned.get('ranks')}, not {rev} with --ranks {ranks}; measure it with --rebaseline")
    missing = [f for f in files if f not in pinned["files"]]
    if missing:
        raise SystemExit(f"no pinned subset for {len(missing)} file(s) in {path} (first: {missing[0]}); "
                         f"measure them with --rebaseline --files ...")
    return {f: pinned["files"][f] for f in files}


def zero3d_commit() -> str:
    """The Zero3D commit the shim ran (with "+" when the worktree had changes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def shim_run(tests: Path, subset: dict[str, list[str]], work: Path, timeout: int, extra: list[str]) -> dict:
    """Run each file's subset through the shim; the results are also kept in ``work/zero3d.json``
    (test id -> latest result), from which the report over every pinned file is assembled."""
    store_path = work / "zero3d.json"
    report = {}
    commit = zero3d_commit()
    for file, ids in subset.items():
        if not ids:
            continue
        record = work / "zero3d" / file.replace("/", "__")
        shutil.rmtree(record, ignore_errors=True)
        results = run_file(tests, file, "zero3d", record, ids, extra, timeout)
        report[file] = {t: {**results[t], "commit": commit} for t in ids}
        store = json.loads(store_path.read_text()) if store_path.exists() else {}
        store.update(report[file])
        store_path.write_text(json.dumps(store, indent=1))
        passed = sum(r["outcome"] == "passed" for r in report[file].values())
        logger.info("zero3d %s: %d of %d pass", file, passed, len(ids))
    return report


def probe_fp16(tests: Path, subset: dict[str, list[str]], work: Path, timeout: int) -> int:
    """Print, per file, how many of the subset's tests skip without fp16 on the CPU (``--probe-fp16``)."""
    total = needs = 0
    for file, ids in subset.items():
        if not ids:
            continue
        record = work / "fp16-probe" / file.replace("/", "__")
        shutil.rmtree(record, ignore_errors=True)
        run_file(tests, file, "fp16-probe", record, ids, [], timeout)
        results = _read_results(record)  # also the module's own id when it skipped as a whole
        module_skipped = results.get(file, {}).get("outcome") == "skipped"
        skipped = sum(module_skipped or results.get(t, {}).get("outcome") == "skipped" for t in ids)
        total, needs = total + len(ids), needs + skipped
        print(f"  {skipped:4d} of {len(ids):<4d} need fp16: {file}", flush=True)
    print(f"fp16 probe: {needs} of {total} tests of the subset skip without fp16 on the CPU")
    return 0


def stored_report(work: Path, subset: dict[str, list[str]]) -> dict:
    """The latest stored result of every test of ``subset`` (a test never run: outcome "not run")."""
    store_path = work / "zero3d.json"
    store = json.loads(store_path.read_text()) if store_path.exists() else {}
    return {file: {t: store.get(t, {"outcome": "not run", "reason": "", "commit": ""}) for t in ids}
            for file, ids in subset.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=PINNED_REV, help="DeepSpeed revision whose tests to run")
    parser.add_argument("--archive", help="URL or path of a .tar.gz of the DeepSpeed repository at --rev")
    parser.add_argument("--git-dir", help="a local DeepSpeed git directory to take --rev from")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "zero3d" / "ds-unit-tests"),
                        help="where tests, baselines and results are kept")
    parser.add_argument("--files", nargs="*", help="only these test files (relative to tests/)")
    parser.add_argument("--match", nargs="*", help="only the subset's tests whose id contains one of these")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one test may take")
    parser.add_argument("--ranks", type=int, default=1,
                        help="CPU 'devices' DeepSpeed's harness may use (its LOCAL_SIZE; tests of a larger world "
                             "size skip); the pinned subset is for 1; 2 or 4 run more tests (slower) and need "
                             "their own --rebaseline")
    parser.add_argument("--build-ops", nargs="*", metavar="BUILDER",
                        help="DeepSpeed op builders to build before the tests (default: those the subset loads, "
                             f"{', '.join(ds_unit_ops.SHIM_OPS)}; with --rebaseline also "
                             f"{', '.join(ds_unit_ops.BASELINE_OPS[len(ds_unit_ops.SHIM_OPS):])}); "
                             "give none to build nothing first")
    parser.add_argument("--build-timeout", type=int, default=3600, help="seconds one op's build may take")
    parser.add_argument("--subset", default=str(SUBSET_FILE), help="the pinned subset (JSON)")
    parser.add_argument("--rebaseline", action="store_true",
                        help="measure the subset of --files with DeepSpeed itself and pin it into --subset")
    parser.add_argument("--baseline-only", action="store_true", help="stop after --rebaseline")
    parser.add_argument("--no-run", action="store_true", help="run nothing: report the stored results")
    parser.add_argument("--probe-fp16", action="store_true",
                        help="count the subset's tests that need fp16 on the CPU (they skip where DeepSpeed's CPU "
                             "accelerator has none): run them with fp16 reported unsupported and initialize refused")
    parser.add_argument("--report", help="also write the results as JSON here")
    parser.add_argument("--docs", help="write the report over every pinned file (stored results) into this "
                                       "Markdown file, between its ds-unit-report markers")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments for the shim run, after --")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(opts.work).expanduser() / opts.rev / (f"ranks{opts.ranks}" if opts.ranks != 1 else "")
    os.environ["LOCAL_SIZE"] = str(opts.ranks)
    tests = obtain_tests(Path(opts.work).expanduser(), opts.rev, opts.archive, opts.git_dir)
    files = opts.files or select_files(tests)
    subset_path = Path(opts.subset)
    if opts.build_ops is None:
        opts.build_ops = list(ds_unit_ops.BASELINE_OPS if opts.rebaseline else ds_unit_ops.SHIM_OPS)
    if opts.build_ops and (opts.rebaseline or not (opts.no_run or opts.baseline_only)):
        ds_unit_ops.build_ops(opts.build_ops, opts.build_timeout)
    if opts.rebaseline:
        pin_subset(subset_path, opts.rev, opts.ranks, baseline(tests, files, work, opts.timeout))
    if not opts.files and not opts.rebaseline and subset_path.exists():  # every file pinned so far
        pinned_files = json.loads(subset_path.read_text())["files"]
        unmeasured = [f for f in files if f not in pinned_files]
        if unmeasured:
            logger.warning("%d selected files have no pinned subset yet (measure them with --rebaseline --files): %s",
                           len(unmeasured), " ".join(unmeasured))
        files = [f for f in files if f in pinned_files]
    subset = load_pinned(subset_path, opts.rev, opts.ranks, files)
    if opts.baseline_only:
        print(f"pinned subset: {sum(map(len, subset.values()))} tests in {len(files)} files pass with DeepSpeed "
              "and call deepspeed.initialize")
        return 0
    if opts.match:
        subset = {f: [t for t in ids if any(m in t for m in opts.match)] for f, ids in subset.items()}
    if opts.probe_fp16:
        return probe_fp16(tests, subset, work, opts.timeout)
    if not opts.no_run:
        report = shim_run(tests, subset, work, opts.timeout, opts.pytest_args)
        ds_unit_report.print_report(report, sys.stdout)
        if opts.report:
            Path(opts.report).write_text(json.dumps(report, indent=1))
    if opts.docs:
        selected = select_files(tests)
        measured = [f for f in selected if f in json.loads(subset_path.read_text())["files"]]
        pinned = load_pinned(subset_path, opts.rev, opts.ranks, measured)
        ds_unit_report.write_docs(Path(opts.docs), stored_report(work, pinned), opts.rev, json.loads(
            subset_path.read_text())["measured_with"], [f for f in selected if f not in measured])
    elif opts.no_run:
        ds_unit_report.print_report(stored_report(work, subset), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
