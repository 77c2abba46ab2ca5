"""The fault probe's cases (scripts/fault_probe.py), by category; each registers itself with
``fault_kit.case`` and fills its `Result` through ``fault_kit.judge``.

Most cases copy the base run (6 steps on 2 ranks, checkpoints global_step3 and global_step6),
do one thing to it, and run the real ``zero3d`` command a user would run next.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from fault_kit import ROOT, Proc, Result, Workspace, case, complete_checkpoint, judge, snapshot

RESUME = ("train.resume=auto", "train.max_steps=9")
GOES_ON = ("run/checkpoints/latest", "run/job.yaml", "run/summary.json")  # what a run that goes on rewrites
STEP6 = "run/checkpoints/global_step6"


# -- damaged checkpoints: the resume is refused and the message names what to do --------------

def _resume_refused(ws: Workspace, r: Result, slug: str, damage: Callable[[Path], None], says: list[str]) -> None:
    where, config, run = ws.copy_run(slug)
    damage(run / "checkpoints")
    before = snapshot(where)
    proc = ws.train(where, config, *RESUME)
    judge(r, proc, where, before, rc=2, says=says)


def _lost_if(r: Result, happened: bool, what: str) -> None:
    """Record ``what`` as lost (and the case as not as expected) when it ``happened``."""
    if happened:
        r.lost.append(what)
        r.as_expected = False


def _flip(file: Path, at: int = 5000) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(data)


def _truncate(file: Path) -> None:
    with open(file, "r+b") as f:
        f.truncate(1000)


def _edit_manifest(root: Path, **fields) -> None:
    path = root / "global_step6" / "checkpoint.json"
    doc = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    path.write_text(json.dumps(doc))


FALLBACK = "the newest complete checkpoint there is global_step3: to resume from it, write global_step3 into"
DAMAGED = [
    ("flipped byte in a rank file", lambda root: _flip(root / "global_step6" / "__0_0.distcp"),
     ["error:", "__0_0.distcp is damaged (altered)", FALLBACK]),
    ("truncated rank file", lambda root: _truncate(root / "global_step6" / "__1_0.distcp"),
     ["error:", "__1_0.distcp is damaged (truncated)", FALLBACK]),
    ("deleted rank file", lambda root: (root / "global_step6" / "__1_0.distcp").unlink(),
     ["error:", "__1_0.distcp is damaged (missing)", FALLBACK]),
    ("rank file of another checkpoint (mixed)",
     lambda root: shutil.copy(root / "global_step3" / "__0_0.distcp", root / "global_step6" / "__0_0.distcp"),
     ["error:", "__0_0.distcp is damaged", FALLBACK]),
    ("manifest of another checkpoint (mixed)",
     lambda root: shutil.copy(root / "global_step3" / "checkpoint.json", root / "global_step6" / "checkpoint.json"),
     ["error:", "the two files come from different checkpoints", FALLBACK]),
    ("manifest not JSON", lambda root: (root / "global_step6" / "checkpoint.json").write_text("{"),
     ["error:", "checkpoint.json is unreadable", FALLBACK]),
    ("manifest field malformed (global_steps 'abc')", lambda root: _edit_manifest(root, global_steps="abc"),
     ["error:", "global_steps", FALLBACK]),
    ("manifest field missing (rng)", lambda root: _edit_manifest(root, rng=None), ["error:", "rng", FALLBACK]),
    ("manifest deleted", lambda root: (root / "global_step6" / "checkpoint.json").unlink(),
     ["error:", "has no checkpoint.json", FALLBACK]),
    ("tensor index (dcp.json) deleted", lambda root: (root / "global_step6" / "dcp.json").unlink(),
     ["error:", "has no dcp.json", FALLBACK]),
    ("latest not a tag (binary garbage)", lambda root: (root / "latest").write_bytes(b"\x00\xffglobal"),
     ["error:", "is not allowed", "the newest complete checkpoint there is global_step6"]),
    ("latest empty", lambda root: (root / "latest").write_text(""),
     ["error:", "latest is empty", "the newest complete checkpoint there is global_step6"]),
    ("latest names a missing checkpoint", lambda root: (root / "latest").write_text("global_step9"),
     ["error:", "global_step9 does not exist", "the newest complete checkpoint there is global_step6"]),
]


def _register_damaged() -> None:
    for number, (name, damage, says) in enumerate(DAMAGED):
        def run(ws: Workspace, r: Result, damage=damage, says=says, slug=f"damaged-{number}") -> None:
            _resume_refused(ws, r, slug, damage, says)
        case("checkpoint", f"resume: {name}", "refused before training; names the damage and the checkpoint to "
             "resume from instead; nothing changed")(run)


_register_damaged()


class _Payload:
    """Pickles as ``open(marker, "w")``: a load that runs pickled code leaves the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_pickle(root: Path, marker: Path) -> None:
    """Replace the first model chunk of global_step6 by a pickle payload, its checksum made to match."""
    import torch
    import xxhash

    tag = root / "global_step6"
    payload = io.BytesIO()
    torch.save({"payload": _Payload(marker)}, payload)
    (tag / "evil.distcp").write_bytes(payload.getvalue())
    doc = json.loads((tag / "dcp.json").read_text())
    name = next(n for n in doc["tensors"] if n.startswith("model/"))
    doc["tensors"][name]["chunks"][0].update(file="evil.distcp", offset=0, length=len(payload.getvalue()),
                                             xxh3_64=xxhash.xxh3_64_intdigest(payload.getvalue()))
    (tag / "dcp.json").write_text(json.dumps(doc))


@case("checkpoint", "resume: a rank file chunk is a pickle payload (checksum matched)",
      "refused by the weights-only loader; the payload never runs")
def pickle_resume(ws: Workspace, r: Result) -> None:
    marker = ws.root / "pickle-resume-RAN"
    _resume_refused(ws, r, "pickle-resume", lambda root: _plant_pickle(root, marker),
                    ["error:", "is not a plain tensor", "nothing in it was run"])
    _lost_if(r, marker.exists(), "the pickle payload ran")


@case("checkpoint", "export: a rank file chunk is a pickle payload",
      "refused by the weights-only loader; the payload never runs; no OUT")
def pickle_export(ws: Workspace, r: Result) -> None:
    where, _, run = ws.copy_run("pickle-export")
    marker = where / "RAN"
    _plant_pickle(run / "checkpoints", marker)
    before = snapshot(where)
    proc = ws.zero3d("export", str(run / "checkpoints" / "global_step6"), str(where / "hf"), cwd=where)
    judge(r, proc, where, before, rc=2, says=["error:", "is not a plain tensor", "nothing in it was run"],
          extra_lost=["the pickle payload ran"] if marker.exists() else [])
    _lost_if(r, (where / "hf").exists(), "hf/ written")


@case("checkpoint", "resume an AdamW checkpoint with engine.optimizer.type=SGD",
      "refused before any state changes, naming both optimizers")
def other_optimizer(ws: Workspace, r: Result) -> None:
    where, config, run = ws.copy_run("other-optimizer")
    before = snapshot(where)
    proc = ws.train(where, config, *RESUME, "engine.optimizer.type=SGD")
    judge(r, proc, where, before, rc=2, says=["error:", "AdamW", "SGD"])


# -- commands that would replace what an earlier run wrote -----------------------------------

def _fresh_start(ws: Workspace, r: Result, slug: str, resume: str, drop_latest: bool, says: list[str]) -> None:
    where, config, run = ws.copy_run(slug)
    if drop_latest:
        (run / "checkpoints" / "latest").unlink()
    before = snapshot(where)
    proc = ws.train(where, config, f"train.resume={resume}", "train.seed=99")
    judge(r, proc, where, before, rc=2, says=says)


@case("earlier run", "resume=false over a run with checkpoints", "refused; nothing changed")
def fresh_over_run(ws: Workspace, r: Result) -> None:
    _fresh_start(ws, r, "fresh-false", "false", False, ["error:", "already holds checkpoints", "train.resume=auto"])


@case("earlier run", "resume=false over a run whose latest was deleted", "refused; nothing changed")
def fresh_without_latest(ws: Workspace, r: Result) -> None:
    _fresh_start(ws, r, "fresh-false-nolatest", "false", True,
                 ["error:", "holds checkpoints (global_step6, global_step3) but no 'latest' file"])


@case("earlier run", "resume=auto over a run whose latest was deleted", "refused; nothing changed")
def auto_without_latest(ws: Workspace, r: Result) -> None:
    _fresh_start(ws, r, "fresh-auto-nolatest", "auto", True,
                 ["error:", "holds checkpoints (global_step6, global_step3) but no 'latest' file"])


@case("earlier run", "resume=false over a run with only metrics.jsonl", "refused; nothing changed")
def fresh_over_metrics(ws: Workspace, r: Result) -> None:
    where, config, run = ws.copy_run("fresh-metrics")
    shutil.rmtree(run / "checkpoints")
    before = snapshot(where)
    proc = ws.train(where, config, "train.resume=false")
    judge(r, proc, where, before, rc=2, says=["error:", "already holds an earlier run's metrics.jsonl"])


@case("earlier run", "resume=auto continues the run (control)",
      "trains steps 7-9 and saves global_step9; global_step3/6 untouched")
def auto_continues(ws: Workspace, r: Result) -> None:
    where, config, run = ws.copy_run("continue")
    before = snapshot(where)
    proc = ws.train(where, config, *RESUME)
    judge(r, proc, where, before, rc=0, says=None, may_change=GOES_ON)
    why = complete_checkpoint(run / "checkpoints" / "global_step9")
    if why is not None:
        r.happened += f"; global_step9: {why}"
        r.as_expected = False


def _export(ws: Workspace, r: Result, slug: str, out: Callable[[Path, Path], Path], *flags: str,
            says: list[str] | None, rc: int = 2, prepare: Callable[[Path, Path], None] | None = None,
            may_change: tuple[str, ...] = ()) -> None:
    where, _, run = ws.copy_run(slug)
    if prepare is not None:
        prepare(where, run)
    before = snapshot(where)
    proc = ws.zero3d("export", str(run / "checkpoints" / "latest"), str(out(where, run)), *flags, cwd=where)
    judge(r, proc, where, before, rc=rc, says=says, may_change=may_change)


@case("export", "export RUN/checkpoints/latest RUN --overwrite", "refused: OUT holds the checkpoint; nothing changed")
def export_over_run(ws: Workspace, r: Result) -> None:
    _export(ws, r, "export-over-run", lambda where, run: run, "--overwrite", says=["error:", "contains the checkpoint"])


@case("export", "export into the checkpoint directory itself", "refused; nothing changed")
def export_into_checkpoint(ws: Workspace, r: Result) -> None:
    _export(ws, r, "export-into-ckpt", lambda where, run: run / "checkpoints" / "global_step6", "--overwrite",
            says=["error:", "global_step6"])


@case("export", "export over a directory that is not an export, without --overwrite", "refused; nothing changed")
def export_over_other(ws: Workspace, r: Result) -> None:
    def notes(where: Path, run: Path) -> None:
        (where / "mine").mkdir()
        (where / "mine" / "notes.txt").write_text("mine\n")

    _export(ws, r, "export-over-other", lambda where, run: where / "mine", says=["error:", "mine"], prepare=notes)


@case("export", "export --overwrite over an earlier export (control)",
      "replaces exactly the earlier export; the run untouched")
def export_overwrite_export(ws: Workspace, r: Result) -> None:
    def first(where: Path, run: Path) -> None:
        proc = ws.zero3d("export", str(run / "checkpoints" / "global_step3"), str(where / "hf"), cwd=where)
        if proc.rc != 0:
            raise RuntimeError(f"the first export failed: {proc.err[-2000:]}")

    _export(ws, r, "export-overwrite", lambda where, run: where / "hf", "--overwrite", says=None, rc=0,
            prepare=first, may_change=("hf/*",))


@case("export", "export --max-shard-size 0", "refused; no OUT")
def export_shard_zero(ws: Workspace, r: Result) -> None:
    _export(ws, r, "export-shard-zero", lambda where, run: where / "hf", "--max-shard-size", "0",
            says=["error:", "--max-shard-size"])


# -- bad inputs ------------------------------------------------------------------------------

@case("input", "model.path whose config.json has auto_map (remote code)",
      "refused unless model.trust_remote_code; its code never runs")
def remote_code(ws: Workspace, r: Result) -> None:
    from tests.test_remote_code import code_dir  # its custom.py leaves model/RAN when run

    where = ws.case_dir("remote-code")
    model = code_dir(where / "model")
    config = ws.write_job(where / "run", where / "job.yaml")
    before = snapshot(where)
    proc = ws.train(where, config, f"model.path={model}", "model.model_type=null", "model.config={}")
    judge(r, proc, where, before, rc=2, says=["error:", "auto_map", "model.trust_remote_code"],
          extra_lost=["its code ran"] if (model / "RAN").exists() else [])


@case("input", "lr: inf (zero3d train override)", "refused before workers start")
def lr_inf_cli(ws: Workspace, r: Result) -> None:
    where = ws.case_dir("lr-inf")
    config = ws.write_job(where / "run", where / "job.yaml")
    before = snapshot(where)
    proc = ws.train(where, config, "engine.optimizer.params.lr=.inf")
    judge(r, proc, where, before, rc=2, says=["error:", "lr", "finite"])


@case("input", "lr: nan (Python API, parallel3d.initialize)", "ConfigError naming the key, before any step")
def lr_nan_api(ws: Workspace, r: Result) -> None:
    import parallel3d
    from parallel3d.errors import ConfigError
    from tests.tiny import ds_config, make_model

    config = ds_config(2, 1, 1, lr=float("nan"))
    try:
        parallel3d.initialize(model=make_model("llama"), config=config)
        proc = Proc(0, "", "initialize accepted lr nan")
    except ConfigError as exc:
        proc = Proc(1, "", f"ConfigError: {exc}")
    judge(r, proc, ws.case_dir("lr-nan"), {}, rc=1, says=["ConfigError", "lr"])


def _bad_ids(ws: Workspace, r: Result, tp: int, form: str) -> None:
    where = ws.case_dir(f"bad-ids-{tp}-{form}")
    proc = ws.zero3d("launch", "--nproc-per-node", "2", str(ROOT / "scripts" / "fault_api.py"), "bad-ids", str(tp),
                     form, cwd=where)
    judge(r, proc, where, {}, rc=1, says=["error:", "train_batch on rank 1: input_ids", "holds 127, outside"],
          extra_lost=[] if "engine unchanged: True" in proc.out else ["the engine changed (or did not say)"])


@case("input", "token id = vocab_size on rank 1, tp 1 (API, dict batch)",
      "every rank stops before the forward; rank 0 says it once; the engine unchanged")
def bad_ids_tp1(ws: Workspace, r: Result) -> None:
    _bad_ids(ws, r, 1, "dict")


@case("input", "token id = vocab_size on rank 1, tp 2 (API, tuple batch)",
      "every rank stops before the forward; rank 0 says it once; the engine unchanged")
def bad_ids_tp2(ws: Workspace, r: Result) -> None:
    _bad_ids(ws, r, 2, "tuple")


# -- signals and kills -----------------------------------------------------------------------

def _job_processes(mark: str) -> list[int]:
    from tests.test_job_signals import job_processes

    return list(job_processes(mark))


def _kill_all(mark: str) -> list[int]:
    """SIGKILL every live process of the job marked ``mark`` (some may end meanwhile); returns their pids."""
    pids = _job_processes(mark)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended early with exit {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing happened within {timeout} s")
        time.sleep(0.2)


def _signal_case(ws: Workspace, r: Result, slug: str, role: str, sig: signal.Signals, rc: int, says: list[str]) -> None:
    """Continue the base run "for ever" (a save every 2 steps), send ``sig`` to the launcher or to
    worker rank 1 once a new checkpoint is out, and check what is left."""
    from tests.test_job_signals import MARK

    where, config, run = ws.copy_run(slug, keep_last=1000)
    before = snapshot(where)
    mark = uuid.uuid4().hex
    err_path = where / "stderr.txt"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(
            [ws.python, "-m", "parallel3d.cli", "train", str(config), "--nproc-per-node", "2", "train.resume=auto",
             "train.max_steps=100000", "train.save_interval=2", "train.save_on_signal=true"],
            cwd=where, env=ws.env(**{MARK: mark}), stdout=subprocess.DEVNULL, stderr=err)
        try:
            latest = run / "checkpoints" / "latest"
            _wait_for(lambda: latest.read_text() not in ("global_step6", ""), launcher)
            if role == "launcher":
                target = launcher.pid
            else:
                from tests.test_job_signals import job_processes

                target = next(pid for pid, (cmd, env) in job_processes(mark).items()
                              if "parallel3d.job.run" in cmd and env.get("RANK") == "1")
            os.kill(target, sig)
            code = launcher.wait(60)
        finally:
            left = _kill_all(mark)
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(10)
    proc = Proc(code, "", err_path.read_text())
    judge(r, proc, where, before, rc=rc, says=says, may_change=GOES_ON + ("stderr.txt",),
          extra_lost=[f"{len(left)} processes of the job outlived it"] if left else [])
    tag = (run / "checkpoints" / "latest").read_text()
    why = complete_checkpoint(run / "checkpoints" / tag)
    if why is not None:
        r.lost.append(f"latest ({tag}) is not whole: {why}")
        r.as_expected = False


@case("signal", "SIGINT (Ctrl-C) to zero3d train", "exit 130; saves the step it stopped after; latest whole")
def sigint_launcher(ws: Workspace, r: Result) -> None:
    _signal_case(ws, r, "sigint", "launcher", signal.SIGINT, 130, ["stopped by SIGINT after step", "continues from"])


@case("signal", "SIGTERM to zero3d train", "exit 143; saves the step it stopped after; latest whole")
def sigterm_launcher(ws: Workspace, r: Result) -> None:
    _signal_case(ws, r, "sigterm", "launcher", signal.SIGTERM, 143, ["stopped by SIGTERM after step", "continues from"])


@case("signal", "SIGTERM to worker rank 1", "exit 143; the whole job stops and saves; latest whole")
def sigterm_worker(ws: Workspace, r: Result) -> None:
    _signal_case(ws, r, "sigterm-worker", "worker", signal.SIGTERM, 143, ["stopped by SIGTERM after step"])


@case("signal", "SIGKILL to worker rank 1", "the job ends (exit 137) naming the killed rank; latest whole")
def sigkill_worker(ws: Workspace, r: Result) -> None:
    _signal_case(ws, r, "sigkill-worker", "worker", signal.SIGKILL, 137, ["was killed by SIGKILL", "worker rank 1"])


def _kill_during_save(ws: Workspace, r: Result, delay: float) -> None:
    """SIGKILL every process of a 2-rank API job that saves back to back, ``delay`` s after its third save."""
    from tests.test_job_signals import MARK

    where = ws.case_dir(f"kill-save-{delay}")
    ckpts, mark = where / "ckpt", uuid.uuid4().hex
    job = subprocess.Popen([ws.python, "-m", "parallel3d.cli", "launch", "--nproc-per-node", "2",
                            str(ROOT / "scripts" / "fault_api.py"), "save-forever", str(ckpts)],
                           cwd=where, env=ws.env(**{MARK: mark}), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    try:
        saved = 0
        while saved < 3:
            line = job.stdout.readline()
            if not line:
                raise RuntimeError("the saving job ended early")
            saved += line.startswith("saved")
        time.sleep(delay)
        _kill_all(mark)
        job.wait(30)
    finally:
        _kill_all(mark)
    tag = (ckpts / "latest").read_text()
    broken = [f"{p.name}: {why}" for p in sorted(ckpts.iterdir())
              if p.is_dir() and not p.name.startswith(".") and (why := complete_checkpoint(p)) is not None]
    r.happened = f"killed after {tag}; checkpoints: {', '.join(sorted(p.name for p in ckpts.iterdir()))}"
    r.lost = broken
    r.clear = None
    r.as_expected = not broken and complete_checkpoint(ckpts / tag) is None


@case("kill", "SIGKILL to every process while it saves (API, 2 ranks, right after a save)",
      "latest names a whole checkpoint; every published checkpoint whole")
def kill_save_now(ws: Workspace, r: Result) -> None:
    _kill_during_save(ws, r, 0.0)


@case("kill", "SIGKILL to every process while it saves (API, 2 ranks, 0.2 s later)",
      "latest names a whole checkpoint; every published checkpoint whole")
def kill_save_later(ws: Workspace, r: Result) -> None:
    _kill_during_save(ws, r, 0.2)


# -- a full disk -----------------------------------------------------------------------------

@case("disk", "disk full during a save (run on a small tmpfs)",
      "stops saying 'no space left on device'; the partial .tmp removed; earlier checkpoints and latest kept")
def disk_full(ws: Workspace, r: Result) -> None:
    where = ws.case_dir("disk-full")
    mount = where / "small"
    mount.mkdir()
    used = sum(p.stat().st_size for p in ws.base().rglob("*") if p.is_file())
    size_kb = (used + 2 ** 20) // 1024  # the run and 1 MiB: not room for another 1.9 MB checkpoint
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        r.skipped = f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'})"
        r.happened = "skipped: " + r.skipped
        return
    try:
        run = mount / "run"
        shutil.copytree(ws.base(), run)
        config = ws.write_job(run, where / "job.yaml")
        before = snapshot(mount)
        proc = ws.train(where, config, *RESUME)
        judge(r, proc, mount, before, rc=2, says=["error:", "no space left on device"], may_change=GOES_ON[1:])
        left = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
        if left:
            r.lost.append(f"left behind: {', '.join(left)}")
            r.as_expected = False
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
