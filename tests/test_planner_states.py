"""The planner's model-state bytes against ``memory_report()``, and both against the ZeRO paper.

Every layout is initialized for real on CPU/gloo and trained one step; on every rank the
planner predicts that rank's report from the model and the layout alone (no process group:
``planner.inventory`` + ``zero.sizing``). Two claims per rank:

* **exact**: the prediction equals ``memory_report()`` in every category, to the byte (padding,
  parameters straddling two shards and Adam's per-piece ``step`` scalar included);
* **the ZeRO paper's formula holds for the parameters the rank holds** (Psi_r, after tensor
  parallelism and the pipeline split): params 2 or 4 Psi_r (/dp at stage 3), gradients the
  same (/dp from stage 2), fp32 master 4 Psi_r/dp and Adam's m and v 8 Psi_r/dp from stage 1,
  within per-unit padding, plus 4 bytes of ``step`` per piece; stage 3 keeps parameters under
  the persistence threshold whole. Under pipeline stages, too, gradients are full at stages
  0-1 and the shard from stage 2 (``planner.states.full_gradients``).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import ds_config, make_model, rank_micro_batches, token_batches

LAYOUTS = {  # name: (world, model kind, model overrides, pp, tp, virtual stages, schedule)
    "dp2": (2, "llama", {}, 1, 1, 1, None),
    "dp4": (4, "gpt2", {}, 1, 1, 1, None),
    "tp2xdp2-kv1": (4, "llama", {"num_key_value_heads": 1}, 1, 2, 1, None),
    "pp2xdp2-tied": (4, "gpt2", {"n_layer": 4}, 2, 1, 1, "1f1b"),
    "pp2xtp2": (4, "llama", {"num_hidden_layers": 4}, 2, 2, 1, "zb_h1"),
    "pp2-interleaved": (2, "llama", {"num_hidden_layers": 4}, 2, 1, 2, "interleaved_1f1b"),
}
CASES = [(name, stage, precision) for name in LAYOUTS for stage in (0, 1, 2, 3) for precision in ("bf16", "fp32")]


def measure(name: str, cases: list[tuple[int, str]], offload: dict | None = None) -> list[dict]:
    """On every rank, for each (stage, precision): the report after one step and where the rank sits.

    ``offload``: ZeRO-Offload's blocks for ``zero_optimization`` (offload_param at stage 3 only).
    The prediction is made by `predict` in the test's own process: the planner prices tensor
    parallelism on a fake default group, which a rank (holding the job's group) cannot make."""
    import parallel3d

    world, kind, overrides, pp, tp, virtual, schedule = LAYOUTS[name]
    dp = world // (pp * tp)
    gas = 2 * pp
    out = []
    for stage, precision in cases:
        model = make_model(kind, **overrides)
        zero = {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 50}
        zero.update(_offload_blocks(offload, stage))
        config = ds_config(stage, gas, dp, **zero)
        config["bf16"] = {"enabled": precision == "bf16"}
        config["tensor_parallel"] = {"size": tp}
        if pp > 1:
            config["pipeline"] = {"stages": pp, "schedule": schedule, "virtual_stages": virtual}
        engine, _, _, _ = parallel3d.initialize(model=model, config=config)
        mesh = engine.mesh
        data = iter(rank_micro_batches(token_batches(1, gas, dp), mesh.local_rank("dp")))
        engine.train_batch(data)
        held = sum(u.numel for u in engine.optimizer.units)  # stage 3 params are released between steps
        whole = [u for u in engine.optimizer.units if u.persistent]
        out.append({"report": engine.memory_report(), "held": held, "units": len(engine.optimizer.units),
                    "pieces": len(engine.optimizer.master_pieces), "kept_whole": sum(u.numel for u in whole),
                    "units_whole": len(whole), "ranks": {a: mesh.local_rank(a) for a in ("tp", "pp", "dp")}})
    return out


def _offload_blocks(offload: dict | None, stage: int) -> dict:
    return {k: v for k, v in (offload or {}).items() if stage == 3 or k != "offload_param"}


def predict(name: str, cases: list[tuple[int, str]], measured: list[list[dict]], offload: dict | None = None) -> None:
    """Add each rank's predicted model states (``predicted``) and parameter count (``psi``) to ``measured``."""
    from parallel3d.planner.inventory import ModelShapes
    from parallel3d.planner.states import ZeroSetup, model_state_bytes

    world, kind, overrides, pp, tp, virtual, _ = LAYOUTS[name]
    dp = world // (pp * tp)
    shapes = ModelShapes(make_model(kind, **overrides), tp)
    for i, (stage, precision) in enumerate(cases):
        blocks = _offload_blocks(offload, stage)
        setup = ZeroSetup(stage, dp, 2 if precision == "bf16" else 4, bucket_size=3000, persistence_threshold=50,
                          offload_optimizer="offload_optimizer" in blocks, offload_params="offload_param" in blocks)
        for rank in measured:
            m, where = rank[i], rank[i]["ranks"]
            layout = shapes.stage_layout(pp, virtual) if pp > 1 else None
            params = shapes.rank_params(tp_rank=where["tp"], pp=pp, pp_rank=where["pp"], layout=layout,
                                        stage3=stage == 3)
            m["predicted"] = model_state_bytes(params, setup, dp_rank=where["dp"], pipelined=pp > 1)
            m["psi"] = params.numel


_cache: dict = {}


def _results(dist, name: str) -> list[list[dict]]:
    if name not in _cache:
        cases = [(s, p) for n, s, p in CASES if n == name]
        _cache[name] = dist.run(LAYOUTS[name][0], measure, name, cases)
        predict(name, cases, _cache[name])
    return _cache[name]


def _case(dist, name: str, stage: int, precision: str) -> list[dict]:
    index = [(s, p) for n, s, p in CASES if n == name].index((stage, precision))
    return [rank[index] for rank in _results(dist, name)]


@pytest.mark.parametrize("name,stage,precision", CASES)
def test_prediction_equals_memory_report(dist, name, stage, precision):
    for rank, m in enumerate(_case(dist, name, stage, precision)):
        assert m["predicted"] == m["report"], (rank, m["predicted"], m["report"])
        assert m["psi"] == m["held"], (rank, "the inventory holds the rank's parameters")


@pytest.mark.parametrize("name,stage,precision", CASES)
def test_report_follows_zero_paper_for_held_params(dist, name, stage, precision):
    world, _, _, pp, tp, _, _ = LAYOUTS[name]
    dp = world // (pp * tp)
    work = 2 if precision == "bf16" else 4
    for rank, m in enumerate(_case(dist, name, stage, precision)):
        psi, units, got = m["psi"], m["units"], m["report"]
        shard = (lambda n: n / dp) if stage > 0 else (lambda n: n)
        want = {
            # stage 3 keeps params under the persistence threshold whole (DeepSpeed's rule)
            "params": work * (m["kept_whole"] + shard(psi - m["kept_whole"])) if stage == 3 else work * psi,
            "gradients": work * psi if stage <= 1 else shard(work * psi),
            "master_params": 0 if work == 4 else shard(4 * psi),
            "optimizer_states": shard(8 * psi) + 4 * m["pieces"],
        }
        # each unit is padded on its own: at most dp - 1 elements whole, under one in a shard;
        # padding is in no piece, so a rank's pieces can fall short of Psi_r/dp by dp - 1 per unit
        whole, part = (units * (dp - 1), units) if stage > 0 else (0, 0)
        stage3_pad = m["units_whole"] * (dp - 1) + units - m["units_whole"]
        bounds = {"params": (0, work * (stage3_pad if stage == 3 else whole)),
                  "gradients": (0, work * (whole if stage <= 1 else part)),
                  "master_params": (0, 0 if work == 4 else 4 * part),
                  "optimizer_states": (-8 * whole, 8 * part)}
        for key, value in want.items():
            lo, hi = bounds[key]
            assert lo <= got[key] - value <= hi, (rank, key, got[key], value, bounds[key])


OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
OFFLOAD_CASES = [(stage, precision) for stage in (1, 2, 3) for precision in ("bf16", "fp32")]


def test_prediction_equals_memory_report_with_offload(dist):
    """ZeRO-Offload: the offloaded bytes move to the host categories, in the report and the prediction
    alike; nothing is dropped (device + host = the bytes without offload, plus the host gradient copy
    and, under fp32, the master that is no longer the working shard)."""
    from zero.sizing import CATEGORIES, HOST_CATEGORIES

    offloaded = dist.run(2, measure, "dp2", OFFLOAD_CASES, OFFLOAD)
    plain = zip(*(_case(dist, "dp2", stage, precision) for stage, precision in OFFLOAD_CASES))  # the same runs
    predict("dp2", OFFLOAD_CASES, offloaded, OFFLOAD)
    for rank, (with_offload, without) in enumerate(zip(offloaded, plain)):
        for (stage, precision), m, base in zip(OFFLOAD_CASES, with_offload, without):
            got = m["report"]
            assert m["predicted"] == got, (rank, stage, precision, m["predicted"], got)
            assert set(got) == set(CATEGORIES + HOST_CATEGORIES)
            assert got["optimizer_states"] == got["master_params"] == 0
            assert got["offloaded_optimizer_states"] == base["report"]["optimizer_states"] > 0
            work = 2 if precision == "bf16" else 4
            grads_host = got["offloaded_gradients"]
            assert grads_host == 4 * base["report"]["gradients"] // work if stage >= 2 else grads_host > 0
            if stage == 3:
                assert got["offloaded_params"] > 0 and got["params"] + got["offloaded_params"] == base["report"]["params"]
            else:
                assert got["offloaded_params"] == 0 and got["params"] == base["report"]["params"]
