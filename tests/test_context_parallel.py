"""Context parallelism (Ulysses and ring) against one process (docs/context_parallel.md).

The tiny Llama has 4 query and 2 key/value heads, so cp 2 splits both and cp 4 repeats each kv
head twice (DeepSpeed's replication); under tp 2 x cp 2 each tp rank holds 2 query heads and 1
kv head. Every layout trains several AdamW steps from the same weights on the same global batch
as the one-process oracle (fp32, fp32 master weights): losses, gradient norms before clipping and
every parameter to 1e-5. One
step's gradient is compared in float64 without the optimizer, to rounding. Ring attention has no
head limit: cp 4 runs with the 2 kv heads as they are, and Mistral with a sliding window of 5
tokens (shorter than the 16-token sequence and than cp 2's chunks).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from tests.tiny import SEQ, ds_config, make_model, max_rel_param_error, oracle_run, rank_micro_batches, token_batches

STEPS = 3
RTOL = 1e-5


@functools.cache
def _data(gas: int, dp: int) -> torch.Tensor:
    return token_batches(STEPS, gas, dp)


def _model(family: str, **overrides) -> torch.nn.Module:
    """The tiny Llama, or a tiny Qwen3 / Mistral of the same sizes (seed 0)."""
    if family == "llama":
        return make_model("llama", **overrides)
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**sizes, **overrides}))


def packed_positions() -> torch.Tensor:
    """Position ids of packed rows: documents of 5, 7 and 4 tokens in the first row, 9 and 7 in
    the second (boundaries inside the ring's chunks and on them). Passed with use_cache False, as
    the engine requires: with a cache transformers builds no packed mask for one process."""
    rows = [[5, 7, 4], [9, 7]]
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


PADDED = {"left": (3, 9), "right": (5, 11)}
"""Padded tokens of a micro-batch's two rows (unequal lengths): left padding covers whole ring
chunks at cp 4 (2 tokens) and leaves query rows that see no key; right padding ends rows early."""


def shape_batch(batch: dict, layout: str = "plain") -> dict:
    """A micro-batch laid out as ``layout``: "plain" as given; "packed" with packed_positions();
    "left" / "right" padded (``PADDED``): an attention_mask with zeros, labels -100 there."""
    if layout == "packed":
        return {**batch, "position_ids": packed_positions(), "use_cache": False}
    if layout in PADDED:
        mask = torch.ones_like(batch["input_ids"])
        for row, count in enumerate(PADDED[layout]):
            mask[row, slice(0, count) if layout == "left" else slice(SEQ - count, SEQ)] = 0
        return {**batch, "attention_mask": mask, "labels": batch["labels"].masked_fill(mask == 0, -100)}
    return batch


@functools.cache
def _oracle(gas: int, dp: int, family: str = "llama", overrides: tuple = (),
            layout: str = "plain") -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """``layout``: every micro-batch's (``shape_batch``), or "alternate": a window's even micro-batches packed."""
    norms: list[float] = []
    shaping = ({"position_ids": [packed_positions(), None]} if layout == "alternate"
               else {"prepare": functools.partial(shape_batch, layout=layout)})
    losses, params = oracle_run(family, _data(gas, dp), model=_model(family, **dict(overrides)), grad_norms=norms,
                                **shaping)
    return losses, params, norms


def train_cp(cp: int, stage: int, dp: int, gas: int = 2, tp: int = 1, normalization: str = "micro_batch",
             deepspeed_key: bool = False, family: str = "llama", method: str = "ulysses",
             overrides: tuple = (), layout: str = "plain", pipeline: dict | None = None) -> tuple[list[float], dict]:
    """``pipeline``: the config's pipeline section (the parameters returned are then the stage's, and
    the losses end with ``eval_batch`` of the first window after training)."""
    import parallel3d

    config = ds_config(stage, gas, dp, stage3_param_persistence_threshold=0)
    config["loss_normalization"] = normalization
    if deepspeed_key:
        config["sequence_parallel_size"] = cp
    else:
        config["context_parallel"] = {"size": cp, "method": method}
    if tp > 1:
        config["tensor_parallel"] = {"size": tp}
    if pipeline is not None:
        config["pipeline"] = pipeline
    engine, _, _, _ = parallel3d.initialize(model=_model(family, **dict(overrides)), config=config)
    assert engine.mesh.cp == cp and engine.mesh.dp == dp
    batches = rank_micro_batches(_data(gas, dp), engine.mesh.local_rank("dp"))
    batches = [shape_batch(batch, ("packed" if i % gas % 2 == 0 else "plain") if layout == "alternate" else layout)
               for i, batch in enumerate(batches)]
    losses, norms = [], []
    for s in range(STEPS):
        losses.append(engine.train_batch(iter(batches[s * gas:(s + 1) * gas])))
        norms.append(engine.get_global_grad_norm())
    if pipeline is not None:
        losses.append(engine.eval_batch(iter(batches[:gas])))
    return losses, engine.full_parameters(), norms


def _check(results: list, gas: int, dp: int, family: str = "llama", overrides: tuple = (),
           layout: str = "plain") -> None:
    want_losses, want_params, want_norms = _oracle(gas, dp, family, overrides, layout)
    for losses, params, norms in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert norms == pytest.approx(want_norms, rel=RTOL)  # before clipping: ZeRO's shards over dp_shard x cp
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs by {err:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cp2_equals_one_process(dist, stage):
    _check(dist.run(2, train_cp, 2, stage, 1), 2, 1)


@pytest.mark.parametrize("stage", [0, 3])
def test_cp4_repeats_kv_heads(dist, stage):
    _check(dist.run(4, train_cp, 4, stage, 1), 2, 1)


@pytest.mark.parametrize("stage", [1, 3])
def test_dp2_cp2(dist, stage):
    _check(dist.run(4, train_cp, 2, stage, 2), 2, 2)


def test_tp2_cp2(dist):
    _check(dist.run(4, train_cp, 2, 2, 1, tp=2), 2, 1)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_families_cp2(dist, family):
    """Qwen3 (q/k norms) and Mistral (its sliding window of 4096 is longer than the sequence)."""
    _check(dist.run(2, train_cp, 2, 3, 1, family=family), 2, 1, family)


WINDOW = (("sliding_window", 5),)  # shorter than the sequence (16) and than cp 2's chunks (4 tokens)
MQA = (("num_key_value_heads", 1),)


@pytest.mark.parametrize("cp, stage, family, overrides", [
    (2, 0, "llama", ()), (4, 3, "llama", ()), (2, 1, "llama", MQA), (2, 3, "mistral", WINDOW),
    (4, 0, "mistral", WINDOW)])
def test_ring_equals_one_process(dist, cp, stage, family, overrides):
    """Ring attention: Llama (2 kv heads, fewer than cp 4; one kv head at cp 2), Mistral's sliding
    window applied by the ring."""
    _check(dist.run(cp, train_cp, cp, stage, 1, family=family, method="ring", overrides=overrides), 2, 1, family,
           overrides)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_qwen3(dist, cp):
    """Qwen3 (q/k norms) trained with ring attention: losses and gradient norms to 1e-5; its
    parameters are compared in float64 (test_float64_gradient) instead. In fp32 this tiny Qwen3's
    layers.1 k_proj is ill-conditioned over three Adam steps: one process with the eager kernel
    ends 4e-5 from one process with sdpa, and sdpa in fp32 1e-4 from float64, so only sdpa itself
    (which Ulysses runs) lands within 1e-5 of the sdpa oracle; the ring, whose blocks combine in
    another order, lands 7e-6 (cp 2) and 4e-5 (cp 4) from it."""
    want_losses, _, want_norms = _oracle(2, 1, "qwen3")
    for losses, _, norms in dist.run(cp, train_cp, cp, 2, 1, family="qwen3", method="ring"):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert norms == pytest.approx(want_norms, rel=RTOL)


@pytest.mark.parametrize("cp, family, overrides", [(2, "llama", ()), (4, "mistral", WINDOW)])
def test_ring_packed_documents(dist, cp, family, overrides):
    """Packed rows (position ids restarting per document): the ring keeps the documents apart as
    one process's mask does (at cp 4 with Mistral's 5-token window too)."""
    _check(dist.run(cp, train_cp, cp, 2, 1, family=family, method="ring", overrides=overrides, layout="packed"), 2,
           1, family, overrides, layout="packed")


@pytest.mark.parametrize("cp, stage, method, layout, eager", [
    (2, 1, "ulysses", "left", True), (2, 3, "ulysses", "packed", False), (2, 3, "ring", "right", False),
    (4, 0, "ring", "left", True)])
def test_padding_and_packing_equal_one_process(dist, cp, stage, method, layout, eager):
    """Padded micro-batches (an attention_mask with zeros, labels -100 there) and, under Ulysses,
    packed documents, trained through the engine. With eager, left padding leaves query rows that
    see no key; one process's eager kernel gives them uniform attention over every key (the
    prediction of each row's first real token comes from one), which both methods reproduce."""
    overrides = (("attn_implementation", "eager"),) if eager else ()
    _check(dist.run(cp, train_cp, cp, stage, 1, method=method, overrides=overrides, layout=layout), 2, 1,
           overrides=overrides, layout=layout)


FOUR_LAYERS = (("num_hidden_layers", 4),)


@pytest.mark.parametrize("method, stage, pipeline, layout", [
    ("ring", 1, {"schedule": "1f1b"}, "plain"),
    ("ulysses", 3, {"schedule": "zb_h1"}, "plain"),
    # padded rows: each micro-batch's mask reaches the attention in its forward and its recompute
    ("ulysses", 1, {"schedule": "1f1b", "activation_checkpointing": True}, "left"),
    # the first micro-batch of each window packed, the second not: each micro-batch's documents reach
    # the ring in its forward and in its backward's recompute, the schedule running them interleaved
    ("ring", 3, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "activation_checkpointing": True},
     "alternate")])
def test_pp2_cp2(dist, method, stage, pipeline, layout):
    """Pipeline stages over context-parallel shards: the stages run this rank's cut of each
    micro-batch and pass its shard of the activations on; each stage's parameters, the losses and
    gradient norms equal one process's, and so does the trained model's eval_batch loss."""
    want_losses, want_params, want_norms = _oracle(2, 1, "llama", FOUR_LAYERS, layout)
    model = _model("llama", **dict(FOUR_LAYERS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(want_params[name])
        window = [shape_batch({"input_ids": _data(2, 1)[0, a, 0], "labels": _data(2, 1)[0, a, 0]},
                              ("packed" if a % 2 == 0 else "plain") if layout == "alternate" else layout)
                  for a in range(2)]
        want_losses = want_losses + [sum(model(**batch).loss.item() for batch in window) / 2]
    results = dist.run(4, train_cp, 2, stage, 1, method=method, overrides=FOUR_LAYERS, layout=layout,
                       pipeline={"stages": 2, **pipeline})
    seen = set()
    for losses, params, norms in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        assert norms == pytest.approx(want_norms, rel=RTOL)
        err, name = max_rel_param_error(params, {n: want_params[n] for n in params})
        assert err < RTOL, f"{name} differs by {err:.2e}"
        seen |= set(params)
    assert seen == set(want_params)


def test_ring_dp2_cp2_zero3(dist):
    _check(dist.run(4, train_cp, 2, 3, 2, method="ring"), 2, 2)


def test_ring_tp2_cp2(dist):
    """Each tp rank holds 2 query heads and 1 kv head; the ring runs over them."""
    _check(dist.run(4, train_cp, 2, 2, 1, tp=2, method="ring"), 2, 1)


def _short_window() -> str:
    import parallel3d
    from parallel3d.errors import ConfigError

    config = {**ds_config(0, 1, 1), "context_parallel": {"size": 2}}
    engine, _, _, _ = parallel3d.initialize(model=_model("mistral", sliding_window=8), config=config)
    ids = _data(1, 1)[0, 0, 0]
    with pytest.raises(ConfigError) as info:
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
    return str(info.value)


def test_sliding_window_shorter_than_the_sequence_is_refused(dist):
    for got in dist.run(2, _short_window):
        assert "mistral's attention: a sliding window of 8 tokens, shorter than the sequence (16)" in got


def test_deepspeed_sequence_parallel_size(dist):
    _check(dist.run(2, train_cp, 2, 0, 1, deepspeed_key=True), 2, 1)


def test_token_mean_dp2_cp2(dist):
    """Equal label counts per micro-batch here, so the token mean is the oracle's mean too."""
    _check(dist.run(4, train_cp, 2, 2, 2, normalization="tokens"), 2, 2)


def _float64_gradient(cp: int, method: str = "ulysses", family: str = "llama", overrides: tuple = (),
                      layout: str = "plain") -> tuple[dict, float]:
    """One forward/backward of a float64 model through the cp cut and the cp attention; the
    gradients summed over cp (each rank's loss is cp times its share, so the mean is the loss)."""
    from parallel3d.config.config import load_config
    from parallel3d.context_parallel import apply_context_parallel, check_context_parallel
    from parallel3d.runtime.mesh import build_mesh

    model = _model(family, **dict(overrides)).double()
    config = load_config({"train_micro_batch_size_per_gpu": 2, "context_parallel": {"size": cp, "method": method}},
                         cp)
    check_context_parallel(model, config)
    split = apply_context_parallel(model, config, build_mesh(1, 1, torch.device("cpu"), cp=cp))
    ids = _data(1, 1)[0, 0, 0]
    loss = split.run(model, shape_batch({"input_ids": ids, "labels": ids}, layout)).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
        g /= cp
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    return grads, float(loss)


@pytest.mark.parametrize("cp, method, family, overrides, layout", [
    (2, "ulysses", "llama", (), "plain"), (4, "ulysses", "llama", (), "plain"), (2, "ring", "llama", (), "plain"),
    (4, "ring", "llama", (), "plain"), (2, "ring", "qwen3", (), "plain"), (4, "ring", "qwen3", (), "plain"),
    (4, "ring", "mistral", WINDOW, "plain"), (2, "ring", "llama", MQA, "plain"), (4, "ring", "llama", (), "packed"),
    (2, "ring", "mistral", WINDOW, "packed"), (2, "ulysses", "llama", (), "packed"),
    (4, "ulysses", "llama", (("attn_implementation", "eager"),), "packed"), (2, "ulysses", "llama", (), "left"),
    (4, "ulysses", "llama", (), "right"),
    (4, "ring", "llama", (), "left"), (2, "ring", "llama", MQA, "right"),
    (4, "ring", "mistral", WINDOW, "right")])
def test_float64_gradient(dist, cp, method, family, overrides, layout):
    """``layout`` "packed": packed documents (position ids restarting); "left", "right": padded rows
    of unequal lengths (``PADDED``). Ulysses with the eager kernel gets transformers' eager mask. (Left
    padding with eager is checked in fp32 only: in a float64 model the eager kernel's float32
    softmax turns a row that sees no key into NaN under one process.)"""
    model = _model(family, **dict(overrides)).double()
    ids = _data(1, 1)[0, 0, 0]
    loss = model(**shape_batch({"input_ids": ids, "labels": ids}, layout)).loss
    loss.backward()
    for grads, got_loss in dist.run(cp, _float64_gradient, cp, method, family, overrides, layout):
        assert got_loss == pytest.approx(loss.item(), rel=1e-12)
        for n, p in model.named_parameters():
            assert torch.allclose(grads[n], p.grad, rtol=1e-10, atol=1e-13), n


BAD_BATCHES = {
    "odd length": (lambda b: {k: v[:, :SEQ - 1] for k, v in b.items()},
                   "sequence length 15 is not divisible by context_parallel"),
    "mask values": (lambda b: {**b, "attention_mask": torch.full_like(b["input_ids"], 2)},
                    "context_parallel takes an attention_mask of 0s and 1s shaped [batch, 16] (padding), got shape "
                    "(2, 16) with other values"),
    "per rank": (lambda b: {k: v.roll(dist.get_rank(), 0) for k, v in b.items()},
                 "were handed different micro-batches"),
    "ring: length 14": (lambda b: {k: v[:, :SEQ - 2] for k, v in b.items()},
                        "the sequence length 14 is not divisible by 2 x context_parallel.size = 4 (ring attention "
                        "cuts it into 2 x 2 chunks"),
}


def _bad_batch(case: str, ids: torch.Tensor, method: str = "ulysses", by_hand: bool = False) -> str:
    """The message for ``case``'s micro-batch, handed to ``train_batch`` or (``by_hand``) to ``engine(...)``."""
    import parallel3d
    from parallel3d.errors import ConfigError

    config = ds_config(0, 1, 1)
    config["context_parallel"] = {"size": 2, "method": method}
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=config)
    batch = BAD_BATCHES[case][0]({"input_ids": ids, "labels": ids})
    with pytest.raises(ConfigError) as info:
        if by_hand:
            engine.backward(engine(**batch).loss)
        else:
            engine.train_batch(iter([batch]))
    return str(info.value)


@pytest.mark.parametrize("case, by_hand", [(case, False) for case in BAD_BATCHES] + [("per rank", True),
                                                                                   ("odd length", True)])
def test_bad_batches(dist, case, by_hand):
    """Refused on every rank, through train_batch and through the DeepSpeed-style engine(batch) call."""
    ids = _data(1, 1)[0, 0, 0]
    for got in dist.run(2, _bad_batch, case, ids, "ring" if case.startswith("ring") else "ulysses", by_hand):
        assert BAD_BATCHES[case][1] in got


def _initialize_error(config_changes: dict, model_changes: dict, world: int) -> str:
    import parallel3d
    from parallel3d.errors import ConfigError

    config = {**ds_config(0, 1, 1), **config_changes}
    config.pop("train_batch_size")
    with pytest.raises(ConfigError) as info:
        parallel3d.initialize(model=make_model("llama", **model_changes), config=config)
    return str(info.value)


@pytest.mark.parametrize("config, model, message", [
    ({"context_parallel": {"size": 4}}, {"num_attention_heads": 2, "num_key_value_heads": 2},
     "2 attention heads per tensor-parallel rank"),
    ({"context_parallel": {"size": 4}}, {"num_key_value_heads": 3, "num_attention_heads": 12, "hidden_size": 48},
     "3 key/value heads per tensor-parallel rank"),
    ({"context_parallel": {"size": 4}}, {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types include ['sliding_attention']"),
])
def test_refused_models_and_layouts(dist, config, model, message):
    for got in dist.run(4, _initialize_error, config, model, 4):
        assert message in got


def test_config_errors():
    from parallel3d.config.config import load_config
    from parallel3d.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="'ulysses' or 'ring'"):
        load_config({**base, "context_parallel": {"size": 2, "method": "rings"}}, 2)
    with pytest.raises(ConfigError, match="context_parallel.size 3 does not divide world size 4"):
        load_config({**base, "context_parallel": {"size": 3}}, 4)
    with pytest.raises(ConfigError, match="are the same axis"):
        load_config({**base, "context_parallel": {"size": 2}, "sequence_parallel_size": 4}, 8)
    config = load_config({**base, "sequence_parallel_size": 2}, 8)
    assert (config.context_parallel.size, config.context_parallel.method, config.data_parallel_size) == (2, "ulysses", 4)


def test_router_load_balancing_loss_is_refused():
    from parallel3d.context_parallel.model import check_model
    from parallel3d.errors import ConfigError

    model = _model("mixtral", output_router_logits=True, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=r"mixtral \(MixtralForCausalLM\): its router's load-balancing loss"):
        check_model(model, 2, 1)
    check_model(_model("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 1)


def _save_at_cp2_load_at_dp2(directory: str) -> bool:
    """A checkpoint written at cp 2 loads at dp 2 (and back): checkpoints do not depend on cp."""
    import parallel3d

    def engine(cp: int):
        config = ds_config(3, 1, 2 // cp, stage3_param_persistence_threshold=0)
        if cp > 1:
            config["context_parallel"] = {"size": cp}
        return parallel3d.initialize(model=make_model("llama", seed=cp), config=config)[0]

    cp_engine = engine(2)
    ids = _data(1, 2)[0, 0, 0]
    cp_engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
    saved = cp_engine.full_parameters()
    cp_engine.save_checkpoint(directory, tag="cp2")
    dp_engine = engine(1)
    dp_engine.load_checkpoint(directory, tag="cp2")
    loaded = dp_engine.full_parameters()
    return all(torch.equal(saved[n], loaded[n]) for n in saved) and dp_engine.global_steps == 1


def test_checkpoint_does_not_depend_on_cp(dist, tmp_path):
    assert all(dist.run(2, _save_at_cp2_load_at_dp2, str(tmp_path)))


def _train_peft_cp2() -> tuple[list[float], dict]:
    import parallel3d
    from tests.peft_tiny import make_peft_model

    config = {**ds_config(2, 2, 1), "context_parallel": {"size": 2}}
    engine, _, _, _ = parallel3d.initialize(model=make_peft_model(), config=config)
    batches = rank_micro_batches(_data(2, 1), 0)
    losses = [engine.train_batch(iter(batches[s * 2:(s + 1) * 2])) for s in range(STEPS)]
    return losses, engine.full_parameters()


def test_peft_lora_cp2(dist):
    """A PEFT-wrapped model: the base model's attention is switched, the wrapper's forward passes the cut on."""
    from tests.peft_tiny import hf_name, make_peft_model

    model = make_peft_model()
    want_losses, want = oracle_run("llama", _data(2, 1), model=model)
    trained = {hf_name(n) for n, p in model.named_parameters() if p.requires_grad}
    for losses, params in dist.run(2, _train_peft_cp2):
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, {hf_name(n): v for n, v in want.items() if hf_name(n) in trained})
        assert err < RTOL, f"{name} differs by {err:.2e}"


class _CountingRing:
    """Stands in for RingAttention: a forward of ``layers`` calls, none of them passing a window."""

    size, method, model_type = 2, "ring", "moshi"

    def reset(self) -> None:
        self.calls = self.windowed = 0


@pytest.mark.parametrize("window, refused", [(8, True), (16, False), (None, False)])
def test_ring_refuses_a_short_window_its_layers_do_not_pass(window, refused):
    """Layers that apply their sliding window only through transformers' mask (moshi's): refused
    when the window is shorter than the sequence, run when it cannot cut anything."""
    from parallel3d.context_parallel.batch import SequenceSplit
    from parallel3d.errors import ConfigError

    attention = _CountingRing()
    split = SequenceSplit(attention, 0, False, 2, ((0, 1) if window else (), window))
    ids = _data(1, 1)[0, 0, 0]

    def forward(**kwargs):
        attention.calls = 2
        return kwargs

    if refused:
        with pytest.raises(ConfigError, match=r"moshi has 2 sliding-window layers of 8 tokens, shorter than the "
                                              r"sequence \(16\), but 0 attention calls passed a sliding_window"):
            split.run(forward, {"input_ids": ids, "labels": ids})
    else:
        assert split.run(forward, {"input_ids": ids, "labels": ids})["input_ids"].shape == (2, 8)


def _differing(batches: list) -> str | None:
    """The cp-group agreement check of a ulysses SequenceSplit over the 2 ranks, on this rank's ``batches``."""
    from types import SimpleNamespace

    from parallel3d.context_parallel.batch import SequenceSplit

    attention = SimpleNamespace(size=2, method="ulysses", group=dist.group.WORLD)
    split = SequenceSplit(attention, dist.get_rank(), token_mean=False, layers=1)
    return split.differing([batch(dist.get_rank()) for batch in batches], torch.device("cpu"))


def _with_nan(rank: int, at: int = 3) -> dict:
    embeds = torch.arange(2 * SEQ * 4, dtype=torch.float32).reshape(2, SEQ, 4)
    embeds[0, at, 1] = float("nan")
    return {"inputs_embeds": embeds, "labels": torch.arange(2 * SEQ).reshape(2, SEQ)}


def _nan_on_rank_1(rank: int) -> dict:
    return _with_nan(rank, 3 + rank)


def test_agreement_check_compares_bits_so_nan_is_not_a_difference(dist):
    """The same micro-batch with a NaN in inputs_embeds on both ranks agrees (NaN != NaN must not
    accuse the loader); the NaN at different places on the two ranks does not."""
    assert dist.run(2, _differing, [_with_nan]) == [None, None]
    for got in dist.run(2, _differing, [_with_nan, _nan_on_rank_1]):
        assert "were handed different micro-batches" in got
