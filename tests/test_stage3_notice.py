"""At stage 3, one start-up line (rank 0) when stage3_param_persistence_threshold keeps more
than half of the parameters whole; none when it shards them."""

from __future__ import annotations

import pytest

from tests.log_lines import log_lines
from tests.tiny import ds_config, make_model


def _start(threshold: int | None) -> tuple[list[str], dict]:
    """initialize a tiny Llama at stage 3 on this rank; (warnings logged by initialize, memory report)."""
    import parallel3d

    extra = {} if threshold is None else {"stage3_param_persistence_threshold": threshold}
    with log_lines("parallel3d.initialize") as lines:
        engine, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(3, 1, 2, **extra))
    units = engine.optimizer.units
    counts = {"total": sum(u.numel for u in units), "whole": sum(u.numel for u in units if u.persistent),
              "tensors": sum(len(u.params) for u in units)}
    return [line for line in lines if "persistence" in line], counts


@pytest.mark.parametrize("threshold", [None, 0])
def test_stage3_says_when_most_parameters_stay_whole(dist, threshold):
    (rank0, counts), (rank1, _) = dist.run(2, _start, threshold)
    assert rank1 == []  # rank 0 only
    if threshold == 0:
        assert rank0 == [] and counts["whole"] == 0
        return
    total, whole, tensors = counts["total"], counts["whole"], counts["tensors"]
    assert whole == total  # the tiny model: every tensor is under DeepSpeed's default 100,000
    assert rank0 == [
        f"ZeRO stage 3 keeps {whole:,} of {total:,} parameters (100%; {tensors} of {tensors} tensors, each under "
        "100,000 elements) whole on every data-parallel rank, as zero_optimization.stage3_param_persistence_threshold "
        "100,000 asks, so their memory is not divided by the 2 ranks (memory_report() shows little saving over stage "
        "2); lower zero_optimization.stage3_param_persistence_threshold (0 shards every tensor) to shard them"]
