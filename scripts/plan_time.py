"""How long `zero3d plan` takes for a 7B Llama, first run (no stored profiles) and repeat run.

The workload of issue 27: LlamaConfig hidden 4096, intermediate 11008, 32 layers and heads,
vocabulary 32000 (built from its config: no download) on 64 A100-80GB, sequence 4096, global
batch 1024. Each first run gets an empty ``ZERO3D_CACHE``; the repeat run reads what the last
first run stored. Wall seconds and CPU seconds (user + system, the profiling workers included)
are the median of ``--runs``. ``--baseline REV`` times that revision of this repository the same
way in the same invocation (a detached git worktree) and prints the ratios, and whether the two
plans are equal byte for byte.

    python scripts/plan_time.py --runs 3 --baseline 73eb270
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["--gpus", "64", "--device", "a100", "--seq-len", "4096", "--global-batch", "1024"]


def _config(directory: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000).save_pretrained(directory)
    return directory


def _run(source: Path, model: Path, cache: Path, extra: list[str]) -> tuple[float, float, bytes]:
    """(wall s, CPU s of the process and its children, stdout) of one ``zero3d plan``."""
    env = {**os.environ, "PYTHONPATH": str(source), "ZERO3D_CACHE": str(cache)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "parallel3d.cli", "plan", str(model), *PLAN, *extra], env=env,
                          cwd=source, capture_output=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, done.stdout


def measure(source: Path, model: Path, scratch: Path, runs: int, extra: list[str]) -> dict:
    first, repeat, outputs = [], [], set()
    for i in range(runs):
        cache = scratch / f"{source.name}-{i}"
        wall, cpu, out = _run(source, model, cache, extra)
        first.append((wall, cpu))
        outputs.add(out)
        wall, cpu, out = _run(source, model, cache, extra)
        repeat.append((wall, cpu))
        outputs.add(out)
    if len(outputs) != 1:
        raise SystemExit(f"{source}: the plan differs between runs")

    def median(pairs, i):
        return statistics.median(p[i] for p in pairs)

    return {"first wall": median(first, 0), "first cpu": median(first, 1), "repeat wall": median(repeat, 0),
            "repeat cpu": median(repeat, 1), "plan": outputs.pop()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", help="a git revision of this repository to time the same way")
    parser.add_argument("--json-top", type=int, default=0, help="compare --top N --json output (0: the table)")
    args = parser.parse_args()
    extra = ["--top", str(args.json_top), "--json"] if args.json_top else []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = _config(scratch / "llama7b")
        sources = {"this tree": ROOT}
        if args.baseline:
            base = scratch / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base), args.baseline],
                           check=True)
            sources[args.baseline] = base
        try:
            results = {name: measure(path, model, scratch, args.runs, extra) for name, path in sources.items()}
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    load = os.getloadavg()[0]
    print(f"zero3d plan, 7B Llama on 64 x A100-80GB, seq 4096, global batch 1024; median of {args.runs}; "
          f"load {load:.1f} at the end")
    print(f"{'':<12} {'first wall s':>12} {'first CPU s':>12} {'repeat wall s':>13} {'repeat CPU s':>12}")
    for name, r in results.items():
        print(f"{name:<12} {r['first wall']:>12.2f} {r['first cpu']:>12.2f} {r['repeat wall']:>13.2f} "
              f"{r['repeat cpu']:>12.2f}")
    if args.baseline:
        new, old = results["this tree"], results[args.baseline]
        print(f"ratio (baseline / this tree): first run {old['first wall'] / new['first wall']:.2f}x wall, "
              f"{old['first cpu'] / new['first cpu']:.2f}x CPU; repeat run {old['repeat wall'] / new['repeat wall']:.2f}x "
              f"wall; the same plan byte for byte: {new['plan'] == old['plan']}")


if __name__ == "__main__":
    main()
