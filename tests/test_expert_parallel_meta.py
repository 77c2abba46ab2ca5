"""A meta-device start under expert parallelism: each rank reads (or replays) only its experts.

``pretrained=`` an HF directory: Mixtral as ``save_pretrained`` writes it (one tensor per expert,
``experts.{e}.w1.weight``, stacked on load by transformers' converter) and Qwen3-MoE with the stacked
``gate_up_proj``/``down_proj`` stored as such. Every safetensors read is recorded: a rank touches no
expert outside its ``[r L, (r + 1) L)``. Its experts equal one process's loaded model's slice, and one
training step matches one process. Without ``pretrained`` the replayed random init equals eager
construction's, experts included.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed

from tests.tiny import rank_micro_batches, token_batches, oracle_run, update_mismatch
from tests.tiny_moe import EXPERTS, ep_config, make_moe

DP, RTOL = 4, 1e-5


@contextlib.contextmanager
def _recorded_reads():
    """Every (key, dim-0 rows or None for a whole tensor) that safetensors hands out meanwhile."""
    import safetensors

    import models.pretrained

    reads: list[tuple[str, tuple[int, int] | None]] = []
    real = safetensors.safe_open

    class Slice:
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def __getitem__(self, rect):
            rows = rect[0] if isinstance(rect, tuple) else rect
            reads.append((self.key, (rows.start, rows.stop)))
            return self.inner[rect]

    class Recorded:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key), key)

        def get_tensor(self, key):
            reads.append((key, None))
            return self.inner.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    safetensors.safe_open = models.pretrained.safe_open = Recorded
    try:
        yield reads
    finally:
        safetensors.safe_open = models.pretrained.safe_open = real


def _start(kind: str, ep: int, directory: str | None) -> dict:
    """On every rank: start from meta (ZeRO 3), the reads, this rank's experts, then one step."""
    import parallel3d

    config = ep_config(3, 1, DP, ep, stage3_param_persistence_threshold=0, reduce_bucket_size=2000)
    with _recorded_reads() as reads:
        engine = parallel3d.initialize(model=make_moe(kind, meta=True), config=config, pretrained=directory)[0]
    names = {p: n for n, p in engine.module.named_parameters()}
    local = {names[p]: v.clone() for p, v in engine.optimizer.full_fp32_params().items() if ".experts." in names[p]}
    batches = rank_micro_batches(token_batches(1, 1, DP), torch.distributed.get_rank())
    loss = engine.train_batch(iter(batches))
    return {"reads": reads, "ep_rank": engine.ep_info.rank, "local": local, "loss": loss,
            "params": engine.full_parameters()}


def _expert_rows(key: str, rows: tuple[int, int] | None) -> range | None:
    """The experts a read touched (None: not an experts tensor)."""
    if (one := re.search(r"\.experts\.(\d+)\.", key)) is not None:
        return range(int(one[1]), int(one[1]) + 1)
    if ".experts." in key:
        return range(*rows) if rows is not None else range(EXPERTS)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Mixtral as save_pretrained writes it (per expert); Qwen3-MoE with its stacked experts stored."""
    from safetensors.torch import save_file

    out = {}
    for kind in ("mixtral", "qwen3_moe"):
        model, path = make_moe(kind, seed=3), tmp_path_factory.mktemp(kind)
        if kind == "mixtral":
            model.save_pretrained(path)
        else:
            save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()}, path / "model.safetensors")
        out[kind] = str(path)
    return out


@pytest.mark.parametrize("kind,ep", [("mixtral", 2), ("qwen3_moe", 4)])
def test_meta_start_reads_only_its_experts_and_trains_like_one_process(dist, saved, kind, ep):
    start = make_moe(kind, seed=3)
    want_start = {n: p.detach().clone() for n, p in start.named_parameters()}
    want_losses, want_params = oracle_run(kind, token_batches(1, 1, DP), model=start)
    local = EXPERTS // ep
    for rank, got in enumerate(dist.run(DP, _start, kind, ep, saved[kind])):
        mine = range(got["ep_rank"] * local, (got["ep_rank"] + 1) * local)
        touched = [(key, rows) for key, rows in got["reads"] if (experts := _expert_rows(key, rows)) is not None
                   and not set(experts) <= set(mine)]
        assert any(_expert_rows(*read) is not None for read in got["reads"]), "no expert read recorded"
        assert not touched, f"rank {rank} read other experts: {touched[:4]}"
        assert got["local"] and all(torch.equal(v, want_start[n][mine.start : mine.stop]) for n, v in got["local"].items())
        assert got["loss"] == pytest.approx(want_losses[0], rel=RTOL)
        ratio, name, rel = update_mismatch(got["params"], want_params, want_start, 1, RTOL)
        assert ratio <= 1, f"{name}: update off by {rel:.2e}"


def test_meta_random_init_equals_eager(dist):
    """No pretrained: the replay of eager init gives each rank its experts' slice of the eager values."""
    want = dict(make_moe("mixtral").named_parameters())
    for got in dist.run(DP, _start, "mixtral", 2, None):
        mine = slice(got["ep_rank"] * EXPERTS // 2, (got["ep_rank"] + 1) * EXPERTS // 2)
        assert got["local"] and all(torch.equal(v, want[n][mine]) for n, v in got["local"].items())
