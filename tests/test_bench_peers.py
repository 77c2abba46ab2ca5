"""The peer benchmarks cannot rot: every runner of scripts/bench_tp_peers.py and
scripts/bench_pp_peers.py takes two steps of a tiny Llama on two ranks (the second with its
collectives counted, as the benchmarks count them), and the step must train and communicate."""

from __future__ import annotations

import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _run_each(module: str) -> dict:
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import importlib

    import torch

    bench = importlib.import_module(module)
    from bench_runners import MODELS, RUNNERS, build_model, count_step, token_batches

    spec = MODELS["T"]
    ids = token_batches(spec, 0, 1)[0]  # the same on both ranks
    out = {}
    for name in bench.NAMES:
        setup, stage = RUNNERS[name]
        model = build_model(spec)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        step, _ = setup(model, spec, stage)
        step(ids)
        comm = count_step(step, ids)
        # parameters this rank kept (a TP shard or a stage's) changed; compare local values
        local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in model.named_parameters()}
        changed = [n for n, p in local.items()
                   if n in before and p.shape == before[n].shape and not torch.equal(p.detach(), before[n])]
        out[name] = (comm["calls"], comm["wire_bytes"], len(changed))
    return out


@pytest.mark.parametrize("module", ["bench_tp_peers", "bench_pp_peers"])
def test_every_peer_runner_steps(dist, module):
    results = dist.run(2, _run_each, module, timeout=240)
    for rank, res in enumerate(results):
        for name, (calls, wire, changed) in res.items():
            assert calls > 0 and wire > 0, f"rank {rank} {name}: no collective counted ({calls} calls, {wire} bytes)"
            assert changed > 0, f"rank {rank} {name}: no parameter changed"


def test_scaling_benchmark_runs_end_to_end(tmp_path, capsys):
    """scripts/bench_scaling.py on the tiny model (six torchrun jobs): a ratio per runner, and the plot;
    then the same table and plot again from the raw results it saved (``--from-json``, no jobs)."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import bench_scaling

    raw = str(tmp_path / "raw.jsonl")
    bench_scaling.main(["--models", "T", "--seqs", "16", "--timeout", "240", "--json", raw,
                        "--plot", str(tmp_path / "scaling.png")])
    measured = capsys.readouterr().out.split("time per token over DDP's")[1]
    bench_scaling.main(["--from-json", raw, "--plot", str(tmp_path / "again.png")])
    again = capsys.readouterr().out.split("time per token over DDP's")[1]
    tables = lambda out: [line for line in out.splitlines()[1:] if not line.startswith("plot:")]  # noqa: E731
    assert tables(again) == tables(measured)  # (the first line has the load average, the last the plot's path)
    wall, cpu = measured.split("CPU seconds per token")
    for table in (wall, cpu):
        rows = [line.split() for line in table.strip().splitlines() if line.startswith("T@")]
        assert [r[0] for r in rows] == ["T@16"]
        assert all(len(r) == 9 and float(x) > 0 for r in rows for x in r[4:]), rows
    assert (tmp_path / "scaling.png").stat().st_size > 1000 and (tmp_path / "again.png").stat().st_size > 1000
    for bad in (["--models", "Q"], ["--seqs", "x"], ["--seqs", "128x0"], ["--nproc", "3"],
                ["--from-json", str(tmp_path / "missing.jsonl")]):
        with pytest.raises(SystemExit):
            bench_scaling.parse_args(bad)


def test_a_benchmark_model_takes_its_sequences_per_micro_batch():
    """``NAME@SEQxMICRO``: the scaling runs compare every model at equal tokens per micro-batch."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    from bench_runners import MODELS, model_spec

    assert (model_spec("A@128x1").seq, model_spec("A@128x1").micro) == (128, 1)
    assert (model_spec("B@256").seq, model_spec("B@256").micro) == (256, MODELS["B"].micro)
    assert model_spec("L") == MODELS["L"]
    for bad in ("A@0", "A@128x0", "A@x1", "A@128x", "Q@128"):
        with pytest.raises(ValueError, match="unknown benchmark model"):
            model_spec(bad)


def test_pipeline_replay_times_a_known_schedule():
    """bench_pp_replay.replay on a hand-made GPipe step of 2 ranks x 2 micro-batches: F costs 1,
    B costs 2, 0.5 of executor CPU before every action but the first, 3 after the last."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    from bench_pp_replay import replay

    def rank(stage: int, order: list[tuple[str, int]]) -> dict:
        events, t = [], 0.0
        for i, (kind, mb) in enumerate(order):
            cpu = 1.0 if kind == "F" else 2.0
            t += 0.0 if i == 0 else 0.5
            events.append((kind, mb, stage, float(i), float(i) + 0.5, t, t + cpu))  # recorded order: by wall start
            t += cpu
        return {"events": events, "cpu0": 0.0, "cpu1": t + 3.0}

    gpipe = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    res = replay([rank(0, gpipe), rank(1, gpipe)])
    # stage 1: F0 at 1-2, F1 at 2.5-3.5, B0 at 4-6, B1 at 6.5-8.5; stage 0 waits for B0 and B1:
    # F0 0-1, F1 1.5-2.5, B0 6-8, B1 8.5-10.5. Span 10.5, step 10.5 + 3.
    assert res["span"] == pytest.approx(10.5) and res["step"] == pytest.approx(13.5)
    assert res["between"] == [1.5, 1.5] and res["tail"] == [3.0, 3.0] and res["compute"] == [6.0, 6.0]
    assert res["bubble"] == pytest.approx(1 - 12 / 21)
    with pytest.raises(RuntimeError, match="deadlocked"):
        replay([rank(0, [("B", 0), ("F", 0)]), rank(1, [("F", 0), ("B", 0)])])  # B before its own F's input


def test_pipeline_replay_benchmark_runs_end_to_end(tmp_path, capsys):
    """scripts/bench_pp_replay.py on the tiny model at pp 4 (one torchrun job, every runner):
    a replayed step for each, and a ratio of each Zero3D schedule to its peers."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import bench_pp_replay

    raw = tmp_path / "replay.json"
    stats = bench_pp_replay.main(["--model", "T", "--layers", "8", "--microbatches", "4", "--steps", "1",
                                  "--warmup", "1", "--timeout", "300", "--json", str(raw)])
    assert sorted(stats) == sorted(bench_pp_replay.NAMES)
    for name, s in stats.items():
        assert s["steps"] == 1 and 0 < s["compute_ms"] <= s["span_ms"] < s["step_ms"], (name, s)
        assert 0 < s["bubble"] < 1, (name, s)
    out = capsys.readouterr().out
    assert out.count("| zzbh1 / ") == 2 and "| zi1f1b / ti1f1b |" in out
    with pytest.raises(SystemExit):
        bench_pp_replay.main(["--only", "zgpipe,nope"])
