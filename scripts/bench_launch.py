"""Start one benchmark runner as its own ``torchrun --standalone`` job (fresh processes, own peaks)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def launch(script: str, name: str, nproc: int, args: list[str], timeout: int, env: dict | None = None) -> bool:
    """Run ``script --runner NAME ARGS`` under torchrun; print the tail of its output if it fails."""
    clean = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    clean["PYTHONPATH"] = ROOT + os.pathsep + clean.get("PYTHONPATH", "")
    clean.setdefault("OMP_NUM_THREADS", "1")
    clean.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(script), "--runner", name, *args]
    proc = subprocess.run(cmd, env=clean, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        print(f"!! {name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}", flush=True)
    return proc.returncode == 0


def runner_parser(doc: str, runners: list[str], model: str, models: list[str], nproc: int):
    """The options every start-up/checkpoint benchmark shares, plus the hidden ones of a runner."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model, choices=models)
    ap.add_argument("--nproc", type=int, default=nproc)
    ap.add_argument("--only", default=",".join(runners), help="comma-separated runners, of: " + ",".join(runners))
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--runner", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap
