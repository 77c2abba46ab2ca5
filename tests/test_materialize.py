"""InitReplay: a meta model's values equal, bit for bit, eager construction's under the same seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from models import init_execute
from models.materialize import (
    InitReplay,
    MaterializeError,
    MetaBuildDrewError,
    NoInitializerError,
    ReplayMismatchError,
    UninitializedTensorError,
)
from models.tensor_source import RectError, TensorSource, whole
from tests.tiny_families import FAMILIES, tiny_config


def _pair(family: str, seed: int = 0, **kwargs):
    """(eager model, generator state after eager construction, the same model built on meta)."""
    return _pair_of(tiny_config(family), seed, **kwargs)


def _pair_of(cfg: PretrainedConfig, seed: int, **kwargs):
    torch.manual_seed(seed)
    eager = AutoModelForCausalLM.from_config(cfg, **kwargs)
    after = torch.get_rng_state()
    torch.manual_seed(seed)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, **kwargs)
    return eager, after, meta


def _reference(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers())
    return {n: t.detach() for n, t in out.items()}


def _rects(shape) -> list[tuple[slice, ...]]:
    """A row range, a single middle row, a column range and an inner block (what TP/ZeRO ask)."""
    if len(shape) == 0:
        return [()]
    n = shape[0]
    rects = [(slice(0, max(1, n // 3)),), (slice(n // 2, n // 2 + 1),)]
    if len(shape) >= 2:
        m = shape[1]
        rects += [(slice(None), slice(m // 4, m // 2 + 1)), (slice(n // 4, n - n // 4), slice(m // 4, m))]
    return rects


@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole_tensors_equal_eager(family):
    eager, after, meta = _pair(family)
    src = InitReplay(meta)
    torch.manual_seed(1234)  # the replay starts from the state captured at InitReplay(), not this one
    got = dict(src.read(whole(src.names())))
    assert torch.equal(torch.get_rng_state(), after), "the generator must end where eager construction left it"
    ref = _reference(eager)
    assert set(src.names()) | set(src.aliases()) == set(ref)
    for name in src.names():
        (value,) = got[name]
        assert value.dtype == ref[name].dtype and torch.equal(value, ref[name]), name
    for alias, canonical in src.aliases().items():
        assert eager.get_parameter(alias) is eager.get_parameter(canonical)


@pytest.fixture(params=["whole", "small_pieces"])
def pieces(request, monkeypatch):
    """Large draws in pieces as usual, or every draw over 128 bytes in 64-byte pieces, so that
    pieces cut rows, rectangles and ragged tails on tiny models."""
    if request.param == "small_pieces":
        monkeypatch.setattr(init_execute, "DRAW_CHUNK_BYTES", 64)
    return request.param


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rectangles_equal_eager(family, pieces):
    eager, after, meta = _pair(family, seed=7)
    src = InitReplay(meta)
    names = src.names() + list(src.aliases())
    requests = {n: _rects(src.shape(n)) for n in names}
    got = dict(src.read(requests))
    assert torch.equal(torch.get_rng_state(), after)
    ref = _reference(eager)
    for name in names:
        assert len(got[name]) == len(requests[name])
        for rect, value in zip(requests[name], got[name]):
            assert value.is_contiguous() and torch.equal(value, ref[name][rect]), (name, rect)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_bf16_equal_eager(family):
    eager, after, meta = _pair(family, seed=3, dtype=torch.bfloat16)
    src = InitReplay(meta)
    got = dict(src.read(whole(src.names())))
    assert torch.equal(torch.get_rng_state(), after)
    ref = _reference(eager)
    assert all(got[n][0].dtype == torch.bfloat16 or n in src.buffer_names() for n in src.names())
    assert all(torch.equal(got[n][0], ref[n]) for n in src.names())


def test_subset_of_one_tensor_draws_the_rest_into_scratch():
    eager, after, meta = _pair("llama", seed=5)
    src = InitReplay(meta)
    name = "model.layers.1.mlp.down_proj.weight"
    ((got_name, (value,)),) = list(src.read({name: [(slice(None), slice(3, 9))]}))
    assert got_name == name and torch.equal(value, eager.get_parameter(name)[:, 3:9])
    assert torch.equal(torch.get_rng_state(), after)
    assert src.last_stats.scratch_random_ops > 0


def test_reads_repeat_and_fill_into_a_flat_buffer(pieces):
    eager, after, meta = _pair("llama_tied", seed=11)
    src = InitReplay(meta)
    first = dict(src.read({n: [(slice(0, 2),)] for n in src.parameter_names()}))
    flat = torch.zeros(sum(src.shape(n).numel() for n in src.names()))
    dests, at = {}, 0
    for n in src.names():  # views into one ZeRO-like flat buffer, filled in place
        k = src.shape(n).numel()
        dests[n] = [((), flat[at : at + k].view(src.shape(n)))]
        at += k
    src.fill(dests)
    assert torch.equal(torch.get_rng_state(), after)
    ref = _reference(eager)
    for n, [(_, dest)] in dests.items():
        assert torch.equal(dest, ref[n]), n
    assert all(torch.equal(first[n][0], ref[n][:2]) for n in first)


def test_buffers_draw_nothing_from_the_generator():
    eager, _, meta = _pair("gemma", seed=2)
    src = InitReplay(meta)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    bufs = dict(src.buffers())
    assert torch.equal(torch.get_rng_state(), before)
    assert src.last_stats.scratch_random_ops == 0
    assert set(bufs) == set(src.buffer_names()) >= {"model.rotary_emb.inv_freq", "model.embed_tokens.embed_scale"}
    assert src.buffer_names(persistent=False) == src.buffer_names()
    assert all(torch.equal(t, eager.get_buffer(n)) for n, t in bufs.items())


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def test_peak_memory_is_one_tensor_not_the_model():
    cfg = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=12, num_attention_heads=4, vocab_size=8000
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    model_bytes = sum(p.numel() * 4 for p in meta.parameters())  # ~54 MB
    largest = max(p.numel() * 4 for p in meta.parameters())  # the embedding, ~8 MB
    src = InitReplay(meta)
    requests = {n: [(slice(0, 1),)] for n in src.names()}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS watermark
        rss_probe = True
    except OSError:
        rss_probe = False
    base = _vm("VmRSS") if rss_probe else 0
    got = dict(src.read(requests))
    stats = src.last_stats
    assert stats.peak_bytes <= 2 * largest, stats
    assert stats.emitted_bytes < 200_000  # one row of each tensor
    if rss_probe:
        grew = _vm("VmHWM") - base
        assert grew < min(0.5 * model_bytes, 3 * largest), (grew, model_bytes, largest)
    assert len(got) == len(src.names())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["normal_", "uniform_"])
def test_draws_in_pieces_equal_one_whole_draw(dtype, op):
    """What drawing large tensors in pieces rests on: the same values, the generator left alike."""
    args = (0.0, 0.02) if op == "normal_" else (-0.1, 0.1)
    for numel, row, chunk in [(17, 1, 64), (4099, 1, 64), (98765, 5, 4096), (3 << 20, 768, 1 << 20)]:
        torch.manual_seed(3)
        whole_draw = getattr(torch.empty(numel, dtype=dtype), op)(*args)
        state = torch.get_rng_state()
        torch.manual_seed(3)
        pieces = init_execute.draw_pieces(numel, row, whole_draw.element_size(), chunk)
        assert pieces[0][0] == 0 and pieces[-1][1] * row == numel
        assert all((b - a) * row % 16 == 0 for a, b in pieces[:-1]) and (pieces[-1][1] - pieces[-1][0]) * row >= 16
        drawn = torch.empty(numel, dtype=dtype)
        for a, b in pieces:
            getattr(drawn[a * row : b * row], op)(*args)
        assert torch.equal(drawn, whole_draw) and torch.equal(torch.get_rng_state(), state), (numel, row, chunk)


def test_a_large_tensor_is_drawn_in_pieces_never_whole():
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=32000)  # a 16 MB embedding and head: drawn in pieces
    eager, after, meta = _pair_of(cfg, 0)
    src = InitReplay(meta)
    name = "model.embed_tokens.weight"
    rows = [(slice(0, 3),), (slice(12000, 20000), slice(5, 9))]
    got = dict(src.read({name: rows, "lm_head.weight": [(slice(31990, 32000),)]}))
    assert torch.equal(torch.get_rng_state(), after)
    for rect, value in zip(rows, got[name]):
        assert torch.equal(value, eager.get_parameter(name)[rect])
    assert torch.equal(got["lm_head.weight"][0], eager.lm_head.weight[31990:])
    assert src.last_stats.peak_bytes <= 2 * init_execute.DRAW_CHUNK_BYTES + 32000 * 128 * 4 // 8, src.last_stats


def test_a_mid_sized_weight_is_drawn_in_pieces_too():
    """A 6 MiB MLP weight (benchmark model B's) is not held whole: no scratch of its size."""
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=12,
                      vocab_size=512)
    eager, after, meta = _pair_of(cfg, 2)
    src = InitReplay(meta)
    name = "model.layers.0.mlp.up_proj.weight"
    largest = eager.get_parameter(name).nbytes
    flat = torch.empty(eager.get_parameter(name).numel())
    src.fill({name: [((slice(None),), flat.view(2048, 768))]})
    assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(flat.view(2048, 768), eager.get_parameter(name))
    assert src.last_stats.peak_bytes <= largest // 2, (src.last_stats, largest)


def test_a_tensor_held_whole_is_not_kept_after_it_is_emitted():
    """An embedding whose padding row is zeroed after its draw is held whole while it is made;
    its storage then goes back to the allocator, not into the replay's spare buffer."""
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=32000, pad_token_id=3)  # a 16 MB embedding with a padding row
    eager, after, meta = _pair_of(cfg, 4)
    src = InitReplay(meta)
    name = "model.embed_tokens.weight"
    got = dict(src.read({name: [(slice(0, 5),)], "lm_head.weight": [(slice(0, 2),)]}))
    assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(got[name][0], eager.get_parameter(name)[:5]) and not got[name][0][3].any()
    assert src.last_stats.peak_bytes >= eager.get_parameter(name).nbytes  # held whole while made
    assert src.last_stats.spare_bytes <= init_execute.spare_limit() < eager.get_parameter(name).nbytes


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.bn = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 50, bias=False)


def test_plain_module_uses_reset_parameters_in_module_order():
    torch.manual_seed(3)
    eager = _Net()
    after = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = _Net()
    src = InitReplay(meta)
    got = dict(src.read(whole(src.names())))
    assert torch.equal(torch.get_rng_state(), after)
    assert all(torch.equal(got[n][0], t) for n, t in eager.state_dict().items())


class _SkippedOnMeta(nn.Module):
    """torch's trunc_normal_/orthogonal_/sparse_ return at once on a meta tensor; eager draws."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.empty(20, 8))
        self.b = nn.Parameter(torch.empty(6, 10))
        self.c = nn.Parameter(torch.empty(12, 5))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.trunc_normal_(self.a, std=0.5)
        nn.init.orthogonal_(self.b)
        nn.init.sparse_(self.c, sparsity=0.5)


def test_init_functions_torch_skips_on_meta_still_draw():
    torch.manual_seed(4)
    eager = nn.Sequential(_SkippedOnMeta(), nn.Linear(3, 3))
    after = torch.get_rng_state()
    torch.manual_seed(4)
    with torch.device("meta"):
        meta = nn.Sequential(_SkippedOnMeta(), nn.Linear(3, 3))
    src = InitReplay(meta)
    got = dict(src.read(whole(src.names())))
    assert torch.equal(torch.get_rng_state(), after)
    assert all(torch.equal(got[n][0], t) for n, t in eager.state_dict().items())


def test_construction_that_draws_on_meta_needs_the_seed():
    # DiffLlama's attention makes lambda_q1... with torch.normal(0, std, size=...): no device
    # argument, so it draws on the CPU even under torch.device("meta").
    cfg = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=97)
    torch.manual_seed(6)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("diffllama", **cfg))
    after = torch.get_rng_state()
    torch.manual_seed(6)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model("diffllama", **cfg))
    assert not torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(6).get_state())
    with pytest.raises(MetaBuildDrewError, match=r"InitReplay\(model, seed=s\)"):
        InitReplay(meta)
    src = InitReplay(meta, seed=6)
    got = dict(src.read(whole(src.names())))
    assert torch.equal(torch.get_rng_state(), after)
    ref = _reference(eager)
    assert all(torch.equal(got[n][0], ref[n]) for n in src.names())


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


def test_plain_module_without_reset_parameters_says_how_to_fix():
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2), _NoReset())
    with pytest.raises(NoInitializerError, match=r"module 1 \(_NoReset\) owns parameters \['w'\].*reset_parameters"):
        InitReplay(meta)


def test_plain_buffer_made_at_construction_has_no_value():
    class Buf(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("pos", torch.arange(4))

    with torch.device("meta"):
        meta = Buf()
    with pytest.raises(UninitializedTensorError, match="pos"):
        InitReplay(meta)


class _TinyConfig(PretrainedConfig):
    model_type = "zero3d_tiny_uninit"

    def __init__(self, hidden=8, **kwargs):
        self.hidden = hidden
        super().__init__(**kwargs)


class _TinyUninit(PreTrainedModel):
    config_class = _TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.scale = nn.Parameter(torch.empty(config.hidden))  # _init_weights never writes it
        self.post_init()


def test_hf_parameter_left_uninitialized_is_named():
    with torch.device("meta"):
        meta = _TinyUninit._from_config(_TinyConfig())
    with pytest.raises(UninitializedTensorError, match=r"scale: .*_init_weights"):
        InitReplay(meta)


def test_meta_model_modified_after_construction_is_refused():
    _, _, meta = _pair("llama")
    with torch.device("meta"):
        meta.lm_head = nn.Linear(32, 50, bias=False)
    with pytest.raises(ReplayMismatchError, match="lm_head.weight"):
        InitReplay(meta)


def test_bad_requests():
    _, _, meta = _pair("llama")
    src = InitReplay(meta)
    assert isinstance(src, TensorSource)
    name = "model.embed_tokens.weight"  # (97, 32)
    for rect, msg in [
        ((slice(0, 98),), "outside shape"),
        ((slice(0, 4, 2),), "step"),
        ((3,), "not a slice"),
        ((slice(None),) * 3, "more dimensions"),
        ([slice(0, 1)], "tuple of slices"),
    ]:
        with pytest.raises(RectError, match=msg):
            list(src.read({name: [rect]}))
    with pytest.raises(KeyError, match="not a parameter or buffer"):
        src.shape("model.nope.weight")


def test_refuses_to_run_inside_a_meta_device_block():
    _, _, meta = _pair("llama")
    with torch.device("meta"), pytest.raises(MaterializeError, match="default device is meta"):
        InitReplay(meta)
