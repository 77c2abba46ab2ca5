"""PEFT (LoRA) models at ZeRO stages 0-3 against one process running the same model (issue 29).

The engine trains only the adapters; the frozen base is laid out by ZeRO like the trained
params (sharded at stage 3) and must come out bit-identical."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed

from tests.peft_tiny import frozen_values, hf_name, make_peft_model
from tests.tiny import (ds_config, max_rel_param_error, oracle_run, rank_micro_batches, token_batches,
                        train_micro_steps)

STEPS, GAS = 4, 2
RTOL = 1e-5


def train_peft(stage: int, dp: int, zero_extra: dict) -> tuple[list[float], dict, dict, dict]:
    """On every rank: train the PEFT model; losses, trained params, frozen params after, memory report."""
    import parallel3d

    model = make_peft_model()
    engine, _, _, _ = parallel3d.initialize(model=model, config=ds_config(stage, GAS, dp, **zero_extra))
    batches = rank_micro_batches(token_batches(STEPS, GAS, dp), torch.distributed.get_rank())
    losses = train_micro_steps(engine, batches, STEPS, GAS)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    with parallel3d.GatheredParameters(frozen):
        after = frozen_values(model.get_base_model())
    return losses, engine.full_parameters(), after, engine.memory_report()


@functools.cache
def oracle(dp: int):
    model = make_peft_model()
    losses, params = oracle_run("llama", token_batches(STEPS, GAS, dp), model=model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return losses, {hf_name(n): p for n, p in params.items() if n in trained}


CASES = [(stage, dp, extra) for dp in (2, 4) for stage, extra in (
    (0, {}), (1, {}), (2, {"reduce_bucket_size": 3000}),
    (3, {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000}))] + [(3, 2, {})]


@pytest.mark.parametrize("stage,dp,extra", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_lora_matches_single_process(dist, stage, dp, extra):
    results = dist.run(dp, train_peft, stage, dp, extra)
    want_losses, want_params = oracle(dp)
    start = frozen_values(make_peft_model().get_base_model())
    for losses, params, frozen, _ in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"
        assert frozen.keys() == start.keys()
        for name, value in start.items():
            assert torch.equal(frozen[name], value), f"frozen {name} changed"


def frozen_memory(dp: int) -> tuple[dict, int, int, int]:
    """Stage 3, every param sharded: the memory report, the frozen base's whole bytes, the largest
    fetch unit's frozen bytes (with half the root units', gathered for the whole micro-batch) and
    the most frozen bytes gathered at once over a step."""
    import parallel3d

    model = make_peft_model()
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    # prefetch one fetch module ahead (DeepSpeed's default budget, 5e7 elements, would gather the
    # whole tiny model ahead); the order is recorded in the first step, prefetched along from the second
    config = ds_config(3, 1, dp, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    fetcher = engine.optimizer.fetcher
    frozen = [u for _, units in fetcher.module_units for u in units if u.frozen]
    frozen += [u for u in fetcher.root_units if u.frozen]
    peak = [0]

    def counting(method):
        def counted(*args):
            method(*args)
            live = sum(u.padded * u.full.element_size() for u in frozen
                       if u.is_materialized or id(u) in fetcher._in_flight)
            peak[0] = max(peak[0], live)
        return counted

    fetcher.gather = counting(fetcher.gather)  # a gather for use
    fetcher._start_gather = counting(fetcher._start_gather)  # and each prefetch
    for batch in rank_micro_batches(token_batches(2, 1, dp), torch.distributed.get_rank()):
        engine.backward(engine(**batch).loss)
        engine.step()
    largest = max(u.padded * u.full.element_size() for _, units in fetcher.module_units for u in units if u.frozen)
    root = sum(u.padded * u.full.element_size() for u in fetcher.root_units if u.frozen)  # the final norm
    return engine.memory_report(), whole, largest + root / 2, peak[0]


def test_frozen_base_is_sharded_at_stage3(dist):
    """Each of 4 ranks keeps a quarter of the frozen base (plus padding), and a step gathers at most
    two fetch units of it at once (besides the root units: the final norm)."""
    for report, whole, largest, peak in dist.run(4, frozen_memory, 4):
        assert whole / 4 <= report["frozen_params"] <= whole / 4 + 4 * 4 * 16  # <= 3 pad elements per unit
        assert 0 < peak <= 2 * largest


def test_frozen_base_is_whole_below_stage3(dist):
    def report(stage):
        return dist.run(2, _report_at, stage)

    for (got, whole) in report(2):
        assert got["frozen_params"] == whole and got["params"] < whole / 10


def _report_at(stage: int) -> tuple[dict, int]:
    import parallel3d

    model = make_peft_model()
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    engine, _, _, _ = parallel3d.initialize(model=model, config=ds_config(stage, 1, 2))
    return engine.memory_report(), whole
