"""The prepared GPU check: one command, one lent GPU, at most 8 minutes (scripts/gpu_suite.sh).

    python scripts/gpu_suite.py --out DIR [--budget-s 480] [--docs] [--cpu-sized]

Three parts, each in its own process, each given what is left of the budget:

1. ``scripts/gpu_check.py`` on one rank (NCCL): Zero3D's correctness cases on the device
   against one plain PyTorch process (ZeRO 0-3, offload, meta start, bf16, resume);
2. ``scripts/bench_bf16_peers.py``: bf16 training of a 1.1B Llama at sequence 2048, Zero3D
   stages 1 and 3 eager and compiled against plain PyTorch eager and compiled, FSDP2 and
   DeepSpeed ZeRO-3, interleaved (tokens/s, MFU against the device's bf16 peak, peak memory);
3. ``zero3d simulate`` of one rank of a 70B Llama job at pp 8 x dp 16 x tp 8 (issue 33 item 2),
   where this checkout has the command; otherwise a row that says it is missing.

Writes ``DIR/gpu_suite.json`` (everything) and ``DIR/gpu_suite.md`` (the tables); ``--docs``
also puts the tables into docs/benchmarks.md between its ``gpu_suite`` markers. A part that
fails or runs out of time is a row saying so; the others still run. ``--cpu-sized`` runs every
part at toy size on the CPU (the test that keeps this script working: tests/test_gpu_suite.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.suite_report import goals, markdown, update_docs  # noqa: E402

GPU = {"check_model": "A", "check_cases": None,
       "bench": ["--model", "1B", "--seq", "2048", "--micro", "2", "--steps", "8", "--warmup", "3", "--rounds", "2"],
       "simulate": {"layers": 80, "tp": 8, "pp": 8, "dp": 16, "seq": 4096, "micro": 1, "stage": 1, "ranks": []},  # []: simulate's own (first, last, fullest stage)
       "check_s": 120, "simulate_s": 150}
CPU = {"check_model": "T", "check_cases": "z3 fp32,z1 bf16",  # test_gpu_check.py runs every case on CPU
       "bench": ["--model", "tiny", "--seq", "64", "--micro", "1", "--steps", "2", "--warmup", "1", "--rounds", "1",
                 "--compile-backend", "aot_eager"],
       "simulate": {"layers": 4, "tp": 2, "pp": 2, "dp": 2, "seq": 64, "micro": 1, "stage": 1, "ranks": [0]},
       "check_s": 240, "simulate_s": 240}

LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
"""Llama 3 70B's shape (80 layers); the CPU-sized suite shrinks it to a toy of the same family."""
LLAMA_TOY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each part starts its own process group
    return env


def run_part(argv: list[str], timeout: float) -> dict:
    """Run one part; its exit status, seconds, and the tail of its output."""
    t = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
        status, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        status = "timeout"
        stdout, stderr = (x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
    return {"status": status, "seconds": round(time.perf_counter() - t, 1), "tail": (stdout + stderr)[-3000:],
            "stdout": stdout}


def check_part(sizes: dict, out: Path, timeout: float) -> dict:
    path = out / "check.jsonl"
    path.unlink(missing_ok=True)
    cases = ["--cases", sizes["check_cases"]] if sizes["check_cases"] else []
    part = run_part([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29531",
                     "scripts/gpu_check.py", "--model", sizes["check_model"], "--json", str(path), *cases], timeout)
    part["cases"] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    del part["stdout"]
    return part


def bench_part(sizes: dict, out: Path, timeout: float) -> dict:
    """The runners start only while they can end 20 s before ``timeout``; what ran is kept either way."""
    path = out / "bench.json"
    path.unlink(missing_ok=True)
    part = run_part([sys.executable, "scripts/bench_bf16_peers.py", "--out", str(path), *sizes["bench"],
                     "--budget-s", str(max(timeout - 20, 1))], timeout)
    part["result"] = json.loads(path.read_text()) if path.exists() else None
    del part["stdout"]
    return part


def simulate_available() -> bool:
    """Whether this checkout's ``zero3d`` has the ``simulate`` command (issue 33 item 2)."""
    done = subprocess.run([sys.executable, "-m", "parallel3d.cli", "simulate", "--help"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    return done.returncode == 0


def simulate_part(sizes: dict, out: Path, timeout: float, cpu_sized: bool, available: bool) -> dict:
    s = sizes["simulate"]
    layout = f"pp {s['pp']} x dp {s['dp']} x tp {s['tp']}"
    if not available:
        return {"status": "skipped", "layout": layout,
                "reason": "`zero3d simulate` is missing from this checkout (issue 33 item 2 not landed yet)"}
    from transformers import LlamaConfig

    model_dir = out / ("llama_toy" if cpu_sized else "llama_70b")
    shape = LLAMA_TOY if cpu_sized else LLAMA_70B
    LlamaConfig(**shape, num_hidden_layers=s["layers"], max_position_embeddings=max(s["seq"], 256)).save_pretrained(model_dir)
    part = run_part([sys.executable, "-m", "parallel3d.cli", "simulate", str(model_dir), "--tp", str(s["tp"]),
                     "--pp", str(s["pp"]), "--dp", str(s["dp"]), "--seq-len", str(s["seq"]),
                     "--micro-batch", str(s["micro"]), "--stage", str(s["stage"]), "--precision", "bf16",
                     "--steps", "2", "--json", *(a for r in s["ranks"] for a in ("--rank", str(r)))], timeout)
    part["layout"] = layout
    part["ranks"] = _json_list(part.pop("stdout")) if part["status"] == 0 else None
    return part


def _json_list(stdout: str) -> list | None:
    """The JSON list ``--json`` printed: stdout from its first line that opens a list."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("[")), None)
    try:
        return json.loads("\n".join(lines[start:])) if start is not None else None
    except ValueError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for gpu_suite.json, gpu_suite.md and the parts' files")
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds for all three parts (default 480)")
    ap.add_argument("--docs", action="store_true", help="also write the tables into docs/benchmarks.md")
    ap.add_argument("--cpu-sized", action="store_true", help="every part at toy size (the test's variant)")
    args = ap.parse_args(argv)
    import torch

    if not args.cpu_sized and not torch.cuda.is_available():
        ap.error("no CUDA device here; run with --cpu-sized for the toy variant")
    sizes = CPU if args.cpu_sized else GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    simulate = simulate_available()
    parts = {"check": check_part(sizes, out, sizes["check_s"])}
    parts["bench"] = bench_part(sizes, out, left() - (sizes["simulate_s"] if simulate else 5))
    parts["simulate"] = simulate_part(sizes, out, max(left(), 1.0), args.cpu_sized, simulate)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "cpu_sized": args.cpu_sized,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "seconds": round(time.perf_counter() - start, 1), "budget_s": args.budget_s, "parts": parts}
    result["goals"] = goals(result)
    (out / "gpu_suite.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "gpu_suite.md").write_text(table)
    if args.docs:
        update_docs(ROOT / "docs" / "benchmarks.md", table)
    print(table)
    failed = parts["check"]["status"] != 0 or any(not c["ok"] for c in parts["check"]["cases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
