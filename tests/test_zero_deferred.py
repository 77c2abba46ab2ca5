"""ZeRO with deferred reduction (the pipeline mode): full gradients through the step, one reduction."""

from __future__ import annotations

import pytest
import torch

from tests.test_zero_parity import GAS, RTOL, STEPS, oracle
from tests.tiny import make_model, max_rel_param_error, rank_micro_batches, token_batches


def deferred_ranks(stage: int) -> tuple[list[float], dict]:
    from models import fetch_unit_modules
    from zero import ZeroOptimizer, ZeroSettings

    model = make_model("llama")
    settings = ZeroSettings(stage=stage, reduce_bucket_size=3000, param_persistence_threshold=0,
                            gradient_clipping=0.5, defer_reduction=True)
    zero = ZeroOptimizer(
        [{"params": list(model.parameters())}],
        lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8),
        None, settings, fetch_modules=fetch_unit_modules(model) if stage == 3 else (),
    )
    batches = rank_micro_batches(token_batches(STEPS, GAS, 2), torch.distributed.get_rank())
    losses = []
    for s in range(STEPS):
        zero.gather_for_step()
        total = torch.zeros(())
        for mb in batches[s * GAS : (s + 1) * GAS]:
            loss = model(**mb).loss
            zero.start_backward(boundary=False)
            (loss / GAS).backward()
            total += loss.detach()
        zero.reduce_gradients()
        zero.step()
        if zero.fetcher is not None:
            zero.fetcher.release_all()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        losses.append(total.item() / GAS)
    names = {p: n for n, p in model.named_parameters()}
    return losses, {names[p]: t for p, t in zero.full_fp32_params().items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deferred_reduction_matches_single_process(dist, stage):
    want_losses, want_params = oracle("llama", 2)
    for losses, params in dist.run(2, deferred_ranks, stage):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"
