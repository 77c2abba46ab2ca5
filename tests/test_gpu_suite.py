"""scripts/gpu_suite.py cannot rot: its CPU-sized variant runs every part end to end here (tiny
Llama, a few steps, one process per part), and its tables and goals are read from its JSON.

On a GPU the same driver runs the 1.1B bf16 benchmark and 70B simulation; here every runner of
the benchmark must still train (the same model on the same tokens: their last losses agree to
bf16's precision), the correctness cases must pass, and the simulation row must either hold
the measured and predicted peaks or say that ``zero3d simulate`` is missing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_bf16_peers import RUNNERS  # noqa: E402
from scripts.suite_report import BEGIN, END, goals, markdown, update_docs  # noqa: E402


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("suite")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--cpu-sized", "--out", str(out), "--budget-s", "600"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_suite.json").read_text()), (out / "gpu_suite.md").read_text()


def test_every_part_runs(suite):
    result, table = suite
    check, bench, simulate = (result["parts"][k] for k in ("check", "bench", "simulate"))
    assert check["status"] == 0 and [c["case"] for c in check["cases"]] == ["z3 fp32", "z1 bf16"]
    assert all(c["ok"] for c in check["cases"]), check["cases"]
    runners = {r["runner"]: r for r in bench["result"]["runners"]}
    assert bench["status"] == 0 and list(runners) == list(RUNNERS), bench["tail"]
    losses = [r["last_loss"] for r in runners.values()]
    for r in runners.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and r["mfu"] is None  # no bf16 peak for a CPU
        assert math.isfinite(r["last_loss"])
    assert max(losses) - min(losses) < 1e-2 * min(losses), losses  # one model, one batch: bf16 rounding apart
    if simulate["status"] == "skipped":
        assert "`zero3d simulate` is missing" in simulate["reason"] and "skipped" in table
    else:
        assert simulate["status"] == 0, simulate["tail"]
        assert simulate["ranks"] and all({"measured_peak_bytes", "predicted_peak_bytes"} <= set(r)
                                         for r in simulate["ranks"])
    assert all(g["met"] is None for g in result["goals"])  # a toy on a CPU judges none of them
    for heading in ("**Correctness**", "**bf16 training**", "**zero3d simulate**", "| goal (issue 33) |"):
        assert heading in table


def _result(speeds: dict[str, float], mfu: float | None) -> dict:
    runners = [{"runner": n, "tokens_per_s": s, "mfu": mfu if n == "zero3d-z1-compiled" else None,
                "achieved_tflops": 1.0, "peak_bytes": 2**30, "last_loss": 1.0} for n, s in speeds.items()]
    return {"cpu_sized": False, "device": "NVIDIA H100 80GB HBM3", "torch": "x", "date": "d", "seconds": 1.0,
            "budget_s": 480.0, "parts": {"check": {"status": 0, "seconds": 1.0, "cases": []},
                                         "bench": {"status": 0, "seconds": 1.0, "result": {"runners": runners}},
                                         "simulate": {"status": "skipped", "layout": "l", "reason": "r"}}}


def test_goals_are_judged_from_the_table():
    met = _result({"zero3d-z1-compiled": 990.0, "torch-compiled": 1000.0, "zero3d-z3": 900.0, "fsdp2": 800.0,
                   "deepspeed-z3": 700.0}, 0.46)
    assert [g["met"] for g in goals(met)] == [True, True, True]
    missed = _result({"zero3d-z1-compiled": 970.0, "torch-compiled": 1000.0, "zero3d-z3": 900.0, "fsdp2": 950.0,
                      "deepspeed-z3": 700.0}, 0.44)
    assert [g["met"] for g in goals(missed)] == [False, False, False]
    partial = _result({"zero3d-z3": 900.0, "fsdp2": 800.0}, None)
    assert [g["met"] for g in goals(partial)] == [None, None, None]


def test_docs_block_is_replaced(tmp_path):
    """benchmarks.md carries the block; the suite's --docs rewrites only what is between the markers."""
    assert BEGIN in (ROOT / "docs" / "benchmarks.md").read_text()
    doc = tmp_path / "b.md"
    doc.write_text(f"before\n{BEGIN}\nold table\n{END}\nafter\n")
    result = _result({"torch-compiled": 1000.0}, None)
    result["goals"] = goals(result)
    update_docs(doc, markdown(result))
    text = doc.read_text()
    assert text.startswith("before\n" + BEGIN) and text.endswith(END + "\nafter\n")
    assert "old table" not in text and "GPU suite on NVIDIA H100" in text
