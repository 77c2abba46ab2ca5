"""Fault probe: the fault categories of issue 35, end to end, against the real ``zero3d`` CLI and
Python API on a tiny Llama with 2 gloo ranks, and a table of what happened.

    python scripts/fault_probe.py [--markdown docs/faults.md] [--only TEXT ...] [--work DIR] [--list]

Categories (scripts/fault_cases.py): damaged, truncated, deleted and mixed checkpoint files and
manifests, a damaged ``latest``, a pickle payload; fresh starts and ``zero3d export --overwrite``
over an earlier run; bad token ids and non-finite learning rates; SIGINT/SIGTERM/SIGKILL to the
job; SIGKILL while a checkpoint is saved; a full disk (a small tmpfs, where the machine lets this
process mount one; the case is skipped with a note otherwise). How a case is judged (clear
message, nothing lost, as expected): scripts/fault_kit.py. 5 to 10 minutes on 2 busy CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fault_cases  # noqa: E402,F401 - registers the cases
from fault_kit import CASES, Result, Workspace, run_cases  # noqa: E402

INTRO = """# Faults: what the probe found

`scripts/fault_probe.py` runs the fault categories of issue 35 end to end against the real `zero3d`
CLI and Python API, on a tiny Llama (2 layers, 512-token BPE) with 2 gloo ranks on CPU. Most
cases copy one finished run (6 steps, checkpoints `global_step3` and `global_step6`), do one
thing to it, and run the command a user would run next. Each row says what was expected, what
happened (exit status and the first line the command printed; `…` is the case directory),
whether the message was **clear** (no traceback; exactly one line names the problem and holds
what the case looks for; log lines and the agent's `zero3d: worker rank N exited` lines aside)
and whether **nothing was lost** (every file there before has its bytes afterwards, except what
the case may change, such as `latest` when a run goes on; files may grow, as `metrics.jsonl`).
"—" in *clear* marks a case that expects no error. Run it again with
`python scripts/fault_probe.py --markdown docs/faults.md` (5 to 10 minutes on 2 busy CPU cores).
"""


def summary(results: Sequence[Result]) -> dict[str, int]:
    tried = [r for r in results if not r.skipped]
    errors = [r for r in tried if r.clear is not None]
    return {"tried": len(tried), "skipped": len(results) - len(tried), "errors": len(errors),
            "clear": sum(bool(r.clear) for r in errors), "nothing_lost": sum(not r.lost for r in tried),
            "as_expected": sum(r.as_expected for r in tried)}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: Sequence[Result]) -> str:
    s = summary(results)
    lines = [f"**{s['tried']} cases tried** ({s['skipped']} skipped): clear errors {s['clear']} of {s['errors']} "
             f"that expect one; nothing lost in {s['nothing_lost']} of {s['tried']}; as expected "
             f"{s['as_expected']} of {s['tried']}.", "",
             "| category | case | expected | what happened | clear | nothing lost | s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        clear = "skipped" if r.skipped else "—" if r.clear is None else "yes" if r.clear else "**no**"
        lost = "skipped" if r.skipped else "yes" if not r.lost else "**no**: " + "; ".join(r.lost)
        lines.append(f"| {r.category} | {_cell(r.name)} | {_cell(r.expected)} | {_cell(r.happened)} | {clear} | "
                     f"{_cell(lost)} | {r.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def markdown(results: Sequence[Result], seconds: float) -> str:
    when = time.strftime("%Y-%m-%d")
    machine = f"{platform.machine()}, Python {platform.python_version()}"
    return f"{INTRO}\nLatest run: {when}, {machine}, {seconds:.0f} s.\n\n{table(results)}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fault_probe.py", description="Run the fault cases and print a table.")
    p.add_argument("--markdown", type=Path, help="also write the table, with an introduction, to this file")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="run only the cases whose name holds one of these")
    p.add_argument("--work", type=Path, help="working directory (default: a temporary one, removed at the end)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cases = [c for c in CASES if not args.only or any(text in c.name for text in args.only)]
    if args.list or not cases:
        print("\n".join(f"{c.category}: {c.name}" for c in CASES))
        return 0 if args.list else 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zero3d-faults-") as tmp:
        workspace = Workspace((args.work or Path(tmp)).resolve())
        results = run_cases(workspace, cases)
    seconds = time.monotonic() - start
    print(table(results))
    if args.markdown:
        args.markdown.write_text(markdown(results, seconds))
    s = summary(results)
    return 0 if s["as_expected"] == s["tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
