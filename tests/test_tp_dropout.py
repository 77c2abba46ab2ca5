"""Dropout under tensor parallelism (parallel3d/tensor_parallel/rng.py), GPT-2 with its default 0.1 dropouts.

What each test holds, and why it is the right comparison:

- masks: replicated activations (embeddings, residuals, row-layer outputs) get the same mask
  on both tp ranks, attention probabilities (each rank's own heads) get different ones;
- training with ZeRO: the replicated parameters stay bit-identical across tp ranks (a mask
  that differed on a replicated activation would give them different gradients);
- recomputation: with activation checkpointing the gradients equal those without it, which
  holds only if the recomputed forward drew the same masks;
- the loss: a dropout loss is a random variable, so it cannot equal the single process's; its
  distribution over masks must. Both sides draw the training-mode loss of the same weights on
  the same batch with independent masks; the means must agree within 4 standard errors of
  their difference, and the variances within 4 standard deviations of the log of their ratio
  (about sqrt(4 / (n - 1)) for two samples of n). At GPT-2's 0.1 the mean moves less than the
  sampling noise of a few dozen draws, but the spread is all dropout: a tp run that dropped
  nothing, or dropped on both ranks with one mask per head pair, would change it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.tiny import VOCAB, ds_config, rank_micro_batches, token_batches
from tests.tiny_tp import make_tp_model, tp_batch, tp_group

DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # GPT-2's defaults
SAMPLES = 64


def stream_draws() -> dict[str, torch.Tensor]:
    """Draws before, inside (nested too) and after a rank stream, twice from the same seed."""
    import torch.distributed as dist

    from parallel3d.tensor_parallel.rng import SplitRegionRNG

    rng, outer, inner = SplitRegionRNG(dist.get_rank()), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    out: dict[str, torch.Tensor] = {}
    for run in range(2):
        torch.manual_seed(0)
        before = torch.rand(4)
        rng.enter(outer, torch.device("cpu"))
        rng.enter(inner, torch.device("cpu"))
        nested = torch.rand(4)
        rng.leave(inner)
        split = torch.rand(4)
        rng.leave(inner)  # not the open entry: ignored
        rng.leave(outer)
        out.update({f"before{run}": before, f"nested{run}": nested, f"split{run}": split, f"after{run}": torch.rand(4)})
    return out


def test_rank_streams(dist):
    r0, r1 = dist.run(2, stream_draws)
    for key in ("before0", "after0"):
        assert torch.equal(r0[key], r1[key]), f"the default stream must agree across tp ranks ({key})"
    for key in ("nested0", "split0"):
        assert not torch.equal(r0[key], r1[key]), f"rank streams must differ ({key})"
    for r in (r0, r1):  # the same seed replays the same draws, inside the rank stream too
        assert all(torch.equal(r[f"{k}0"], r[f"{k}1"]) for k in ("before", "nested", "split", "after"))
    torch.manual_seed(0)
    torch.rand(4)
    torch.randint(1 << 62, (1,))
    assert torch.equal(r0["after0"], torch.rand(4)), "the default stream continues after one draw (the entry's seed)"


class _DropoutMasks(torch.overrides.TorchFunctionMode):
    """Records (input shape, kept-positions mask) of every functional dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.dropout:
            self.masks.append((tuple(args[0].shape), out != 0))
        return out


def gpt2_masks() -> list[tuple[tuple[int, ...], torch.Tensor]]:
    from parallel3d.tensor_parallel import apply_tensor_parallel

    model = make_tp_model("gpt2", attn_implementation="eager", **DROPOUT)
    apply_tensor_parallel(model, tp_group(2))
    model.train()
    torch.manual_seed(1)
    with _DropoutMasks() as recorder:
        model(**tp_batch(model.config.vocab_size))
    return recorder.masks


def test_masks_agree_on_replicated_and_differ_on_split_activations(dist):
    r0, r1 = dist.run(2, gpt2_masks)
    n_layer, heads = 2, 4
    assert len(r0) == len(r1) == 1 + 3 * n_layer  # embeddings; per block attention probs, attention out, mlp out
    split = [i for i, (shape, _) in enumerate(r0) if len(shape) == 4]
    assert len(split) == n_layer and all(r0[i][0][1] == heads // 2 for i in split)
    for i, ((shape, m0), (_, m1)) in enumerate(zip(r0, r1)):
        if i in split:
            assert not torch.equal(m0, m1), f"dropout {i} {shape}: a rank's heads need their own mask"
        else:
            assert torch.equal(m0, m1), f"dropout {i} {shape}: replicated activations need one mask on all ranks"


def train_with_dropout() -> tuple[list[float], dict[str, torch.Tensor]]:
    import parallel3d

    config = ds_config(3, 2, 1, stage3_param_persistence_threshold=0)
    config["tensor_parallel"] = {"size": 2}
    engine, _, _, _ = parallel3d.initialize(model=make_tp_model("gpt2", vocab_size=VOCAB, **DROPOUT), config=config)
    torch.manual_seed(5)
    data_iter = iter(rank_micro_batches(token_batches(3, 2, 1), 0))
    losses = [engine.train_batch(data_iter) for _ in range(3)]
    return losses, engine.full_parameters()


def test_trains_with_replicated_params_identical_across_tp(dist):
    (l0, p0), (l1, p1) = dist.run(2, train_with_dropout)
    assert l0 == l1 and all(torch.isfinite(torch.tensor(l0)))
    for name in p0:
        assert torch.equal(p0[name], p1[name]), f"{name} differs across tp ranks after training with dropout"


def grads_with_checkpointing(checkpointing: bool, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    from parallel3d.tensor_parallel import apply_tensor_parallel

    model = make_tp_model("gpt2", **DROPOUT)
    apply_tensor_parallel(model, tp_group(2), sequence_parallel=sequence_parallel)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    torch.manual_seed(2)
    model(**tp_batch(model.config.vocab_size)).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [False, True])
def test_recomputation_replays_the_masks(dist, sp):
    plain = dist.run(2, grads_with_checkpointing, False, sp)
    recomputed = dist.run(2, grads_with_checkpointing, True, sp)
    for rank, (want, got) in enumerate(zip(plain, recomputed)):
        for name in want:
            err = ((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)).item()
            assert err < 1e-5, f"rank {rank}: grad of {name} differs by {err:.2e} (recomputation sums in another order)"


def dropout_losses() -> dict[str, list[float]]:
    """Training-mode losses of the same weights and batch over independent mask draws."""
    from parallel3d.tensor_parallel import apply_tensor_parallel

    full = make_tp_model("gpt2", **DROPOUT)
    model = copy.deepcopy(full)
    apply_tensor_parallel(model, tp_group(2))
    batch = tp_batch(full.config.vocab_size)
    out: dict[str, list[float]] = {}
    with torch.no_grad():
        torch.manual_seed(11)
        out["tp"] = [model.train()(**batch).loss.item() for _ in range(SAMPLES)]
        torch.manual_seed(12)
        out["single"] = [full.train()(**batch).loss.item() for _ in range(SAMPLES)]
    return out


def _mean_and_error(xs: list[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return t.mean().item(), (t.var() / len(xs)).item()


def test_dropout_loss_tracks_single_process(dist):
    r = dist.run(2, dropout_losses)[0]
    tp, tp_var = _mean_and_error(r["tp"])
    single, single_var = _mean_and_error(r["single"])
    sigma = (tp_var + single_var) ** 0.5
    assert abs(tp - single) < 4 * sigma, f"tp mean {tp:.5f} vs single {single:.5f} (sigma {sigma:.2e})"
    log_ratio = math.log(tp_var / single_var)
    assert abs(log_ratio) < 4 * math.sqrt(4 / (SAMPLES - 1)), f"loss variance tp / single = {math.exp(log_ratio):.2f}"
