"""The collective counter: exact counts for known calls, ZeRO's volume per step, TP's per layer.

What is asserted, and why it is exact rather than approximate:

* ZeRO at dp = 2 on the tiny Llama (Psi = its parameter count). Every ZeRO collective moves
  whole flat units, each padded to a multiple of dp, so the counted elements equal sums of
  ``unit.padded`` exactly; "within padding" means Psi <= sum(padded) < Psi + units x dp.
  In the ZeRO paper's accounting (an all-reduce of Psi costs 2 Psi, a reduce-scatter plus an
  all-gather Psi + Psi), per step of one micro-batch:
  - stage 0: all-reduce of the gradients, Psi (paper volume 2 Psi);
  - stages 1, 2: reduce-scatter Psi + all-gather Psi = 2 Psi; with gradient accumulation
    stage 1 still reduce-scatters once per step, stage 2 once per micro-batch;
  - stage 3 (persistence threshold 0, so every parameter is sharded): per micro-batch each
    block unit is all-gathered twice (forward, then again before its backward) and
    reduce-scattered once, so blocks cost 3 x their size; the root units (embedding, head,
    final norm) are gathered once per micro-batch and held through its backward, so they
    cost 2 x. Volume = 3 Psi - Psi_root (2.69 Psi here, where the root is 31% of the model;
    -> 3 Psi for models whose blocks dominate).
  Besides, every step all-reduces 1 element (train_batch's mean loss over dp) and, with
  clipping and stage > 0, 2 elements (the squared grad norm over dp).
* TP = 2 on the tiny Llama (L = 2 layers, b x s x h = 2 x 16 x 32): forward 2 all-reduces of
  b*s*h per layer (attention and MLP outputs), backward 2 more (their input gradients), plus
  one forward all-reduce of b*s*h for the vocab-parallel embedding, one backward all-reduce
  of b*s*h for the head's input gradient, and the vocab-parallel cross entropy's b*s
  (max) and 2*b*s (sum of exponentials, target logit); the step adds 1 element (the tp part
  of the squared grad norm). With sequence parallelism each all-reduce of a layer becomes an
  all-gather + reduce-scatter pair (the same ring bytes), the blocks' entry split and exit
  gather add one of each, and the norms' partial gradients are all-reduced (2 x h per layer).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny import MICRO, SEQ, ds_config, make_model, rank_micro_batches, token_batches


def _summary(counter) -> dict:
    """{(tag, group, op): (calls, numel, {size: calls})} for pickling back to the test."""
    return {(r["tag"], r["group"], r["op"]): (r["calls"], r["numel"], dict(r["sizes"])) for r in counter.summary()}


# -- known calls ------------------------------------------------------------------------------


def known_calls() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallel3d.runtime.comm_counter import count_collectives

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    original = dist.ProcessGroup.__dict__["allreduce"]
    x = torch.full((10,), float(rank + 1))
    with count_collectives(mesh) as comm:
        patched = dist.ProcessGroup.__dict__["allreduce"] is not original
        dist.all_reduce(x)  # 1 + 2 = 3 everywhere: results unchanged
        with comm.tag("gathers"), count_collectives() as inner:  # nested, default names
            dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
            dist.all_gather_single(torch.empty(8, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
            dist.all_gather([torch.empty(3), torch.empty(3)], torch.ones(3))
        work = dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6), async_op=True)
        work.wait()
        dist.reduce_scatter_single(torch.empty(3, dtype=torch.bfloat16), torch.ones(6, dtype=torch.bfloat16))
        dist.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(2)])
        dist.broadcast(torch.ones(5), src=0)
        ops = [dist.P2POp(dist.isend, torch.ones(7), 1 - rank), dist.P2POp(dist.irecv, torch.empty(7), 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        dist.all_reduce(torch.ones(1), group=mesh["tp"].get_group())
    restored = dist.ProcessGroup.__dict__["allreduce"] is original
    dist.all_reduce(torch.ones(1))  # not counted after exit
    return {"outer": _summary(comm), "inner": _summary(inner), "x": x.tolist(), "patched": patched,
            "restored": restored, "rows": comm.summary(), "wire": comm.total("wire_bytes"),
            "calls": comm.total("calls"), "table": comm.table()}


def test_known_calls_are_counted_exactly(dist):
    for res in dist.run(2, known_calls):
        assert res["patched"] and res["restored"]
        assert res["x"] == [3.0] * 10
        assert res["outer"] == {
            ("", "dp", "all_reduce"): (1, 10, {10: 1}),
            ("gathers", "dp", "all_gather"): (3, 8 + 8 + 6, {8: 2, 6: 1}),  # output size, all spellings
            ("", "dp", "reduce_scatter"): (3, 6 + 6 + 4, {6: 2, 4: 1}),  # input size, all spellings
            ("", "dp", "broadcast"): (1, 5, {5: 1}),
            ("", "dp", "send"): (1, 7, {7: 1}),
            ("", "dp", "recv"): (1, 7, {7: 1}),
            ("", "tp", "all_reduce"): (1, 1, {1: 1}),  # a group of one: counted, nothing on the wire
        }
        # the inner counter saw only the gathers; without a mesh the world group is "world"
        assert res["inner"] == {("", "world", "all_gather"): (3, 22, {8: 2, 6: 1})}
        by_op = {(r["group"], r["op"]): r for r in res["rows"]}
        assert by_op[("dp", "reduce_scatter")]["nbytes"] == 6 * 4 + 6 * 2 + 4 * 4  # fp32, bf16, fp32
        # ring bytes at n = 2: all-reduce 2(n-1)/n = 1x, RS/AG (n-1)/n = 1/2x, broadcast/p2p 1x
        want_wire = 40 * 1 + (32 + 64 + 24) / 2 + (24 + 12 + 16) / 2 + 20 + 28 + 28 + 0
        assert res["wire"] == pytest.approx(want_wire)
        assert res["calls"] == 11
        assert "all_gather" in res["table"] and "2x8" in res["table"]


def functional_calls() -> dict:
    """Functional collectives and a DTensor redistribution, counted with ``functional=True``."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from parallel3d.runtime.comm_counter import count_collectives

    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
    with count_collectives() as plain:
        funcol.all_reduce(torch.ones(10), "sum", dist.group.WORLD).wait()
    with count_collectives(functional=True) as comm:
        y = funcol.all_reduce(torch.ones(10), "sum", dist.group.WORLD)
        funcol.reduce_scatter_tensor(torch.ones(8), "sum", 0, dist.group.WORLD).wait()
        full = d.redistribute(mesh, [Replicate()]).to_local()  # all-gather of 2 x 2 x 6
        dist.all_reduce(torch.ones(3))  # the class patch still counts the plain ones
    return {"plain": plain.total("calls"), "rows": _summary(comm), "y": y.wait().tolist(), "full": full.shape[0]}


def test_functional_collectives_are_counted(dist):
    for res in dist.run(2, functional_calls):
        assert res["plain"] == 0  # without functional=True they are not seen
        assert res["y"] == [2.0] * 10 and res["full"] == 4
        assert res["rows"] == {("", "world", "all_reduce"): (2, 13, {10: 1, 3: 1}),
                               ("", "world", "reduce_scatter"): (1, 8, {8: 1}),
                               ("", "world", "all_gather"): (1, 24, {24: 1})}


# -- ZeRO: elements per step vs Psi -----------------------------------------------------------


def zero_step(stage: int, gas: int) -> dict:
    import parallel3d
    from parallel3d.runtime.comm_counter import count_collectives

    model = make_model("llama")
    psi = sum(p.numel() for p in model.parameters())
    config = ds_config(stage, gas, 2, stage3_param_persistence_threshold=0, reduce_bucket_size=3000)
    engine, opt, _, _ = parallel3d.initialize(model=model, config=config)
    data = iter(rank_micro_batches(token_batches(2, gas, 2), engine.mesh.local_rank("dp")))
    engine.train_batch(data)  # warm-up (stage 3 records its execution order)
    with count_collectives(engine.mesh) as comm:
        engine.train_batch(data)
    units = opt.units
    root = opt.layout.root_units
    return {
        "psi": psi,
        "padded": sum(u.padded for u in units),
        "n_units": len(units),
        "root_padded": sum(u.padded for u in root),
        "once_padded": sum(u.padded for u in opt.fetcher.once_per_use_units) if opt.fetcher else 0,
        "persistent_padded": sum(u.padded for u in units if u.persistent),
        "counts": {op: comm.total("numel", op=op, group="dp")
                   for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")},
        "small_all_reduces": sorted(c.numel for c in comm.select(op="all_reduce") if c.numel <= 3),
        "n_params": len(list(model.parameters())),
        "flag_all_reduces": sum(1 for c in comm.select(op="all_reduce") if c.numel == len(list(model.parameters()))),
        "groups": sorted({c.group for c in comm.calls}),
    }


def zero_all() -> dict:
    return {(stage, gas): zero_step(stage, gas) for stage in (0, 1, 2, 3) for gas in (1, 2)}


@pytest.fixture(scope="module")
def zero_counts(dist):
    results = dist.run(2, zero_all)
    assert results[0].keys() == results[1].keys()
    return results


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_elements_per_step(zero_counts, stage, gas):
    for by_case in zero_counts:
        r = by_case[(stage, gas)]
        psi, padded, c = r["psi"], r["padded"], r["counts"]
        assert r["groups"] == ["dp"]
        # one all-reduce of a flag per param: which params got a gradient on some rank
        flags = r["n_params"]
        assert r["flag_all_reduces"] == 1
        # one element before the forward: whether every rank's micro-batches are valid token ids
        # (parallel3d/engine/batch_check.py), and one after: the mean loss
        checks = 2
        if stage == 0:  # unsharded buffers: no padding, one all-reduce of every gradient per step
            assert padded == psi
            assert c == {"all_reduce": psi + checks + flags, "reduce_scatter": 0, "all_gather": 0, "broadcast": 0}
            assert r["small_all_reduces"] == [1, 1]  # the batch check, the mean loss; the norm needs no dp sum
            continue
        assert psi <= padded < psi + r["n_units"] * 2  # "within padding"
        # batch check, loss; the squared grad norms of the shards ([replicated, model-parallel, expert])
        assert r["small_all_reduces"] == [1, 1, 3]
        # On gloo (these tests) zero.comm reduces a unit into its shard with an all-reduce of
        # the unit and gathers with one broadcast per owner's chunk (faster there, see
        # zero/comm.py); on NCCL the same element counts go through reduce_scatter/all_gather.
        reduced, gathered = c["all_reduce"] - checks - 3 - flags, c["broadcast"]
        assert c["reduce_scatter"] == c["all_gather"] == 0
        if stage in (1, 2):
            reduces_per_step = 1 if stage == 1 else gas  # stage 2 keeps only shards: reduce each micro-batch
            assert (reduced, gathered) == (reduces_per_step * padded, padded)
            if gas == 1:
                volume = reduced + gathered
                assert volume == 2 * padded and volume / psi == pytest.approx(2.0, rel=1e-3)
        else:
            # the root (final norm) once per micro-batch, so are the embedding table (for its forward)
            # and the untied head (from its forward to its backward); each block twice
            root, once = r["root_padded"], r["once_padded"]
            blocks = padded - root - once
            assert r["persistent_padded"] == 0 and 0 < root < padded and 0 < once < padded
            assert (reduced, gathered) == (gas * padded, gas * (root + once + 2 * blocks))
            if gas == 1:
                volume = reduced + gathered
                assert volume == 3 * padded - root - once
                assert 2.0 < volume / psi < 3.0


# -- TP: per layer vs theory ------------------------------------------------------------------


def tp_step(sequence_parallel: bool) -> dict:
    import parallel3d
    from parallel3d.runtime.comm_counter import count_collectives

    config = ds_config(1, 1, 1)
    config["tensor_parallel"] = {"size": 2, "sequence_parallel": sequence_parallel}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    batches = rank_micro_batches(token_batches(2, 1, 1), 0)
    for i, mb in enumerate(batches):
        with count_collectives(engine.mesh) as comm:
            with comm.tag("forward"):
                loss = engine(**mb).loss
            with comm.tag("backward"):
                engine.backward(loss)
            with comm.tag("step"):
                engine.step()
    cfg = engine.module.config
    return {"summary": _summary(comm), "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "wire": {t: comm.total("wire_bytes", tag=t) for t in ("forward", "backward")}}


@pytest.fixture(scope="module")
def tp_counts(dist):
    return {sp: dist.run(2, tp_step, sp) for sp in (False, True)}


def test_tp_all_reduces_per_layer(tp_counts):
    for r in tp_counts[False]:
        L, h = r["layers"], r["hidden"]
        bs = MICRO * SEQ
        bsh = bs * h
        assert r["summary"] == {
            # per layer 2 (attention, MLP outputs) + the vocab-parallel embedding's lookup;
            # the cross entropy's max (b*s) and [sum exp, target logit] (2*b*s); engine(...)'s batch check (1)
            ("forward", "tp", "all_reduce"): (2 * L + 4, (2 * L + 1) * bsh + 3 * bs + 1,
                                              {bsh: 2 * L + 1, bs: 1, 2 * bs: 1, 1: 1}),
            # per layer 2 (the regions' input grads) + the lm head's input grad
            ("backward", "tp", "all_reduce"): (2 * L + 1, (2 * L + 1) * bsh, {bsh: 2 * L + 1}),
            ("step", "tp", "all_reduce"): (1, 1, {1: 1}),  # tp-split part of the squared grad norm
        }


def test_tp_sequence_parallel_per_layer(tp_counts):
    for r, plain in zip(tp_counts[True], tp_counts[False]):
        L, h = r["layers"], r["hidden"]
        bs = MICRO * SEQ
        bsh = bs * h
        # The 2 reduce-scatters of b*s*h per layer (row outputs forward, region entries
        # backward) are all-reduces on gloo (these tests): an all-reduce and a local slice
        # is three times faster there (parallel3d/tensor_parallel/comm.py).
        assert r["summary"] == {
            # region entries gather the sequence (2 per layer) + the last block's exit gather
            ("forward", "tp", "all_gather"): (2 * L + 1, (2 * L + 1) * bsh, {bsh: 2 * L + 1}),
            # row outputs (2 per layer), embedding, CE, engine(...)'s batch check
            ("forward", "tp", "all_reduce"): (4 + 2 * L, (1 + 2 * L) * bsh + 3 * bs + 1,
                                              {bsh: 1 + 2 * L, bs: 1, 2 * bs: 1, 1: 1}),
            ("backward", "tp", "all_gather"): (2 * L + 1, (2 * L + 1) * bsh, {bsh: 2 * L + 1}),  # + first block's split
            # region entries (2 per layer), head input grad, the norms' partial grads (2 per layer, h each)
            ("backward", "tp", "all_reduce"): (4 * L + 1, (1 + 2 * L) * bsh + 2 * L * h, {bsh: 1 + 2 * L, h: 2 * L}),
            ("step", "tp", "all_reduce"): (1, 1, {1: 1}),
        }
        # ring bytes: the all-reduces', plus the gathers (half of an all-reduce each at n = 2:
        # the one extra pair and, on gloo, one per reduce-scatter done as an all-reduce) and the norm grads
        extra = {"forward": bsh * 4 / 2 * (1 + 2 * L), "backward": bsh * 4 / 2 * (1 + 2 * L) + 2 * L * h * 4}
        for tag in ("forward", "backward"):
            assert r["wire"][tag] == pytest.approx(plain["wire"][tag] + extra[tag])
