"""The tables of scripts/gpu_suite.py: its JSON as markdown, the issue's goals, the docs block."""

from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "<!-- gpu_suite:begin -->", "<!-- gpu_suite:end -->"
LABEL = {"zero3d-z1": "Zero3D ZeRO-1", "zero3d-z1-compiled": "Zero3D ZeRO-1 compiled", "zero3d-z3": "Zero3D ZeRO-3",
         "zero3d-z3-compiled": "Zero3D ZeRO-3 compiled", "torch": "PyTorch (autocast)",
         "torch-compiled": "PyTorch (autocast) compiled", "fsdp2": "FSDP2", "deepspeed-z3": "DeepSpeed ZeRO-3"}


def _runners(result: dict) -> dict[str, dict]:
    bench = (result["parts"]["bench"] or {}).get("result") or {}
    return {r["runner"]: r for r in bench.get("runners", []) if "error" not in r}


def goals(result: dict) -> list[dict]:
    """Issue 33's goals for the GPU table, each with its value and whether it is met (None: not
    measured, or the CPU-sized variant, whose toy model says nothing about them)."""
    runners = _runners(result)
    speed = lambda name: runners.get(name, {}).get("tokens_per_s")  # noqa: E731

    def ratio(a: str, b: str) -> float | None:
        return speed(a) / speed(b) if speed(a) and speed(b) else None

    z1c = ratio("zero3d-z1-compiled", "torch-compiled")
    mfu = runners.get("zero3d-z1-compiled", {}).get("mfu")
    ahead = [ratio("zero3d-z3", peer) for peer in ("fsdp2", "deepspeed-z3")]
    judged = not result["cpu_sized"]
    rows = [
        {"goal": "compiled Zero3D ZeRO-1 within 2% of compiled PyTorch (tokens/s ratio >= 0.98)", "value": z1c,
         "met": None if z1c is None else z1c >= 0.98},
        {"goal": "Zero3D ZeRO-1 compiled at >= 45% MFU (bf16)", "value": mfu, "met": None if mfu is None else mfu >= 0.45},
        {"goal": "Zero3D ZeRO-3 ahead of FSDP2 and DeepSpeed ZeRO-3 (tokens/s ratios > 1)", "value": ahead,
         "met": None if None in ahead else all(r > 1 for r in ahead)},
    ]
    return [dict(row, met=row["met"] if judged else None) for row in rows]


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _check_table(part: dict) -> list[str]:
    lines = [f"**Correctness** (scripts/gpu_check.py, one rank): {_status(part)}", "",
             "| case | ok | loss err | param err | CUDA peak MiB |", "|---|---|---|---|---|"]
    for c in part.get("cases", []):
        e = c.get("errors", {})
        lines.append(f"| {c['case']} | {'yes' if c['ok'] else 'NO'} | {_num(e.get('loss'), '.1e')} | "
                     f"{_num(e.get('params'), '.1e')} | {_num(c.get('cuda_peak_mib'), '.0f')} |")
    return lines


def _bench_table(part: dict) -> list[str]:
    bench = part.get("result") or {}
    shape = bench.get("shape", {})
    head = (f"**bf16 training** (scripts/bench_bf16_peers.py): {_status(part)}; model {bench.get('model', '-')}, "
            f"{shape.get('micro', '-')} x {shape.get('seq', '-')} tokens a step, {bench.get('rounds', '-')} rounds of "
            f"{bench.get('steps', '-')} timed steps, compile backend {bench.get('compile_backend', '-')}")
    lines = [head, "", "| runner | tokens/s | vs PyTorch compiled | MFU | TFLOP/s | peak GiB | last loss | rounds run |",
             "|---|---|---|---|---|---|---|---|"]
    runners = bench.get("runners", [])
    base = next((r.get("tokens_per_s") for r in runners if r["runner"] == "torch-compiled"), None)
    for r in runners:
        if "error" in r:
            lines.append(f"| {LABEL.get(r['runner'], r['runner'])} | failed: {r['error'][:120]} | | | | | | |")
            continue
        vs = r["tokens_per_s"] / base if base else None
        peak = r["peak_bytes"] / 2**30 if r.get("peak_bytes") else None
        lines.append(f"| {LABEL.get(r['runner'], r['runner'])} | {r['tokens_per_s']:,.0f} | {_num(vs, '.3f')} | "
                     f"{_num(r['mfu'] * 100 if r['mfu'] is not None else None, '.1f')}{'%' if r['mfu'] else ''} | "
                     f"{r['achieved_tflops']:.1f} | {_num(peak, '.2f')} | {r['last_loss']:.4f} | {r.get('rounds', '-')} |")
    return lines


def _simulate_table(part: dict) -> list[str]:
    if part["status"] == "skipped":
        return [f"**zero3d simulate** ({part['layout']}): skipped: {part['reason']}"]
    lines = [f"**zero3d simulate** ({part['layout']}): {_status(part)}", ""]
    ranks = part.get("ranks") or []
    if ranks:
        lines += ["| rank (pp stage) | measured peak MiB | predicted peak MiB | measured / predicted | model states MiB |",
                  "|---|---|---|---|---|"]
        for r in ranks:
            if "error" in r:
                lines.append(f"| {r.get('rank', '-')} | failed: {str(r['error'])[:120]} | | | |")
                continue
            m, p = r["measured_peak_bytes"], r["predicted_peak_bytes"]
            states = r.get("measured", {}).get("model_states")
            lines.append(f"| {r['rank']} ({r.get('pp_rank', '-')}) | {m / 2**20:,.1f} | {p / 2**20:,.1f} | {m / p:.3f} | "
                         f"{_num(states and states / 2**20, ',.1f')} |")
    return lines


def _status(part: dict) -> str:
    status = part["status"]
    word = "ok" if status == 0 else "TIMED OUT" if status == "timeout" else f"FAILED (exit {status})"
    return f"{word} in {part['seconds']} s"


def markdown(result: dict) -> str:
    parts = result["parts"]
    lines = [f"GPU suite on {result['device']}, torch {result['torch']}, {result['date']}, "
             f"{result['seconds']} s of a {result['budget_s']:.0f} s budget"
             + (" (CPU-sized variant)" if result["cpu_sized"] else "") + ".", ""]
    lines += _check_table(parts["check"]) + [""] + _bench_table(parts["bench"]) + [""] + _simulate_table(parts["simulate"])
    lines += ["", "| goal (issue 33) | value | met |", "|---|---|---|"]
    for g in result["goals"]:
        value = g["value"]
        shown = ", ".join(_num(v, ".3f") for v in value) if isinstance(value, list) else _num(value, ".3f")
        lines.append(f"| {g['goal']} | {shown} | {'-' if g['met'] is None else 'yes' if g['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def update_docs(path: Path, table: str) -> None:
    """Replace the text between the gpu_suite markers of ``path`` with ``table``."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block to fill")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}{END}", text, count=1))
