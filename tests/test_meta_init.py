"""A model built on the meta device starts with the weights eager construction gives, on every layout.

The reference is ``torch.manual_seed(0); AutoModelForCausalLM.from_config(cfg)`` in one
process. The same seed, the model built under ``torch.device("meta")`` and handed to
``initialize``: every parameter (gathered back whole over dp and tp) and every buffer must be
bit-equal, whatever the ZeRO stage and tensor-parallel size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel3d.errors import ConfigError
from tests.tiny import ds_config, make_model


def _config(kind: str):
    return make_model(kind).config


def _eager(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = _config(kind)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _meta(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = _config(kind)
    torch.manual_seed(0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _start_on_meta(kind: str, stage: int, tp: int, pp: int) -> tuple[set[str], list[str], list[str], bool]:
    """On every rank: initialize from meta; the params it holds, and those and buffers that differ from eager."""
    import parallel3d

    world = torch.distributed.get_world_size()
    eager = _eager(kind)
    after_eager = torch.get_rng_state()
    config = ds_config(stage, 1, world // tp // pp, stage3_param_persistence_threshold=0)
    config["tensor_parallel"] = {"size": tp}
    config["pipeline"] = {"stages": pp}
    model = _meta(kind)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    rng_continues = torch.equal(torch.get_rng_state(), after_eager)
    full = engine.full_parameters()
    want = dict(eager.named_parameters(remove_duplicate=False))
    bad_params = [n for n, p in full.items() if not torch.equal(p, want[n].detach())]
    buffers = dict(model.named_buffers())
    bad_buffers = [n for n, b in eager.named_buffers() if n in buffers and not torch.equal(buffers[n], b)]
    return set(full), bad_params, bad_buffers, rng_continues


LAYOUTS = [(stage, world, tp, 1) for stage in (0, 1, 2, 3) for world, tp in ((2, 1), (2, 2))] + [
    (3, 4, 2, 1), (2, 4, 2, 1), (1, 2, 1, 2), (3, 2, 1, 2), (3, 4, 2, 2), (2, 4, 1, 2)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stage,world,tp,pp", LAYOUTS)
def test_meta_start_equals_eager(dist, kind, stage, world, tp, pp):
    held = set()
    for rank, (names, bad_params, bad_buffers, rng_continues) in enumerate(dist.run(world, _start_on_meta, kind, stage, tp, pp)):
        held |= names
        assert not bad_params, (rank, bad_params)
        assert not bad_buffers, (rank, bad_buffers)
        assert rng_continues, (rank, "the global RNG does not continue where eager construction leaves it")
    assert held >= {n for n, _ in _eager(kind).named_parameters()}  # every parameter was compared somewhere


def test_meta_single_process_trains_like_eager():
    import parallel3d

    eager_engine, _, _, _ = parallel3d.initialize(model=_eager("llama"), config=ds_config(3, 1, 1))
    meta_engine, _, _, _ = parallel3d.initialize(model=_meta("llama"), config=ds_config(3, 1, 1))
    ids = torch.arange(16).reshape(2, 8)
    for engine in (eager_engine, meta_engine):
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    want = eager_engine.full_parameters()
    assert all(torch.equal(p, want[n]) for n, p in meta_engine.full_parameters().items())


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return (x @ self.w).sum()


def test_meta_module_without_initializer_is_named():
    import parallel3d

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _NoInit())
    with pytest.raises(ConfigError, match="_NoInit"):
        parallel3d.initialize(model=model, config=ds_config(0, 1, 1))


def test_meta_frozen_parameters_get_their_eager_values():
    import parallel3d

    eager = _eager("llama")
    model = _meta("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    engine, _, _, _ = parallel3d.initialize(model=model, config=ds_config(3, 1, 1))
    assert torch.equal(model.model.embed_tokens.weight, eager.model.embed_tokens.weight)
    full = engine.full_parameters()
    assert "model.embed_tokens.weight" not in full
    assert all(torch.equal(p, dict(eager.named_parameters())[n]) for n, p in full.items())


# -- pretrained weights ------------------------------------------------------------------


def _start_pretrained(kind: str, directory: str, stage: int, tp: int, pp: int, on_meta: bool) -> dict:
    """On every rank: initialize from ``directory``; the parameters this rank holds, gathered whole."""
    import parallel3d

    world = torch.distributed.get_world_size()
    config = ds_config(stage, 1, world // tp // pp, stage3_param_persistence_threshold=0)
    config["tensor_parallel"] = {"size": tp}
    config["pipeline"] = {"stages": pp}
    model = _meta(kind) if on_meta else make_model(kind, seed=5)
    engine, _, _, _ = parallel3d.initialize(model=model, config=config, pretrained=directory)
    return engine.full_parameters()


@pytest.fixture(scope="module", params=["single", "sharded"])
def saved(request, tmp_path_factory):
    """Tiny Llama and GPT-2 checkpoints written by save_pretrained (one file, or shards with an index)."""
    out = {}
    for kind in ("llama", "gpt2"):
        model = make_model(kind, seed=3)
        path = tmp_path_factory.mktemp(f"{kind}-{request.param}")
        model.save_pretrained(path, max_shard_size="20KB" if request.param == "sharded" else "5GB")
        out[kind] = (str(path), {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stage,world,tp,pp,on_meta", [(3, 2, 1, 1, True), (2, 4, 2, 1, True), (1, 4, 2, 2, True),
                                                       (3, 2, 1, 1, False)])
def test_pretrained_equals_saved(dist, saved, kind, stage, world, tp, pp, on_meta):
    directory, want = saved[kind]
    held = set()
    for full in dist.run(world, _start_pretrained, kind, directory, stage, tp, pp, on_meta):
        held |= set(full)
        assert [n for n, p in full.items() if not torch.equal(p, want[n])] == []
    assert held >= {n for n, _ in make_model(kind).named_parameters()}


def test_pretrained_bad_directories_are_named(tmp_path):
    import parallel3d

    with pytest.raises(ConfigError, match=str(tmp_path)):
        parallel3d.initialize(model=_meta("llama"), config=ds_config(0, 1, 1), pretrained=tmp_path)
    model = make_model("llama", seed=3)
    model.save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match=r"model\.safetensors.*(shape|\[)"):
        parallel3d.initialize(model=_meta_wider(), config=ds_config(0, 1, 1), pretrained=tmp_path / "small")


def _meta_wider() -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = _config("llama")
    cfg.intermediate_size = 96
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_model_partly_on_meta_is_refused():
    import parallel3d

    model = _meta("llama")
    model.lm_head = nn.Linear(32, 128, bias=False)
    with pytest.raises(ConfigError, match="partly on the meta device"):
        parallel3d.initialize(model=model, config=ds_config(0, 1, 1))


@pytest.mark.parametrize("size,packed,pad,world,replicas", [
    (12, 3, False, 2, 1), (10, 1, True, 4, 1), (8, 2, False, 4, 1), (9, 1, True, 2, 1),
    (8, 1, False, 4, 2), (4, 1, False, 4, 4),  # kv heads replicated: 2 pieces on 4 ranks, 1 piece on 4
])
def test_shard_source_runs_rebuild_the_shard(size, packed, pad, world, replicas):
    """The runs a meta start reads from the full tensor give exactly ``ShardSpec.shard``'s piece,
    and ``unshard`` of every rank's piece is the full tensor again."""
    from parallel3d.tensor_parallel.sharding import make_spec

    full = torch.arange(size * 3, dtype=torch.float32).reshape(size, 3)
    spec = make_spec(size, 0, world, packed=packed, pad=pad, replicas=replicas)
    assert torch.equal(spec.unshard([spec.shard(full, rank, world) for rank in range(world)]), full)
    for rank in range(world):
        want = spec.shard(full, rank, world)
        got = torch.zeros_like(want)
        for shard_start, full_start, count in spec.source_runs(0, want.shape[0], rank, world):
            got[shard_start : shard_start + count] = full[full_start : full_start + count]
        assert torch.equal(got, want), rank


def test_storageless_parameters_never_allocate_their_size():
    """A meta model's parameters become storage-less without ever asking for their bytes: a 4 TiB
    one (more than any host or device holds) costs one element, and sharding it stays storage-less."""
    from parallel3d.build.meta_init import detach_from_meta
    from parallel3d.build.storageless import is_storageless
    from parallel3d.tensor_parallel.sharding import make_spec

    with torch.device("meta"):
        layer = nn.Linear(1 << 20, 1 << 20, bias=False)
    detach_from_meta(layer, iter(()), torch.device("cpu"))
    weight = layer.weight
    assert weight.shape == (1 << 20, 1 << 20) and weight.device.type == "cpu" and is_storageless(weight)
    assert weight.untyped_storage().nbytes() == weight.element_size()
    shard = make_spec(1 << 20, 0, 4).shard(weight, 1, 4)
    assert shard.shape == (1 << 18, 1 << 20) and is_storageless(shard)
    assert not is_storageless(torch.zeros(3)) and not is_storageless(torch.zeros(4)[:1].expand(4))
