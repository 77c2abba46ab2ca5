"""ZeRO driven pass by pass (the windowed protocol a pipeline uses: begin_window, begin_pass/end_pass, finish_window).

Each micro-batch's backward is a pass over one chunk (the whole model), the last one marked:
stages 2-3 reduce-scatter after every pass (or, with keep_full_gradients, once after the last),
stages 0-1 reduce once after the last. The result must equal one process.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_zero_parity import GAS, RTOL, STEPS, oracle
from tests.tiny import make_model, max_rel_param_error, rank_micro_batches, token_batches


def pipelined_ranks(stage: int, keep_full: bool) -> tuple[list[float], dict]:
    from models import fetch_unit_modules
    from parallel3d.runtime.mesh import ProcessGroups
    from zero import ZeroOptimizer, ZeroSettings
    from zero.inputs import FetchModules

    model = make_model("llama")
    settings = ZeroSettings(stage=stage, reduce_bucket_size=3000, param_persistence_threshold=0,
                            gradient_clipping=0.5, windowed=True, keep_full_gradients=keep_full)
    zero = ZeroOptimizer(
        [{"params": list(model.parameters())}],
        lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8),
        ProcessGroups(), settings, fetch=FetchModules(fetch_unit_modules(model) if stage == 3 else ()),
    )
    batches = rank_micro_batches(token_batches(STEPS, GAS, 2), torch.distributed.get_rank())
    losses = []
    for s in range(STEPS):
        zero.begin_window()
        total = torch.zeros(())
        window = batches[s * GAS : (s + 1) * GAS]
        for i, mb in enumerate(window):
            loss = model(**mb).loss
            zero.begin_pass(0, last=i == len(window) - 1)
            (loss / GAS).backward()
            zero.end_pass()
            total += loss.detach()
        assert zero.tied_gradients([]) == []
        zero.finish_window()
        zero.step()
        zero.end_window()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        losses.append(total.item() / GAS)
    names = {p: n for n, p in model.named_parameters()}
    return losses, {names[p]: t for p, t in zero.full_fp32_params().items()}


@pytest.mark.parametrize("stage,keep_full", [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)])
def test_pass_by_pass_reduction_matches_single_process(dist, stage, keep_full):
    want_losses, want_params = oracle("llama", 2)
    for losses, params in dist.run(2, pipelined_ranks, stage, keep_full):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"
