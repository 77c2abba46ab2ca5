"""Token ids outside the vocabulary, negative ids, empty micro-batches and packed rows without
use_cache=False stop with one message on every rank, at tp 1 and tp 2 alike, before the forward
changes anything (issue 35), also where only one rank's batch is bad (in train_batch and in a
direct engine(...) call alike)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from parallel3d.engine.batch_check import batch_problem, positional_names, vocab_size_of
from tests.test_checkpoint import _error
from tests.tiny import ds_config
from tests.tiny_tp import make_tp_model

VOCAB = 127  # tests.tiny_tp's llama


def _batch(**changes) -> dict:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch.update(changes)
    return batch


def as_tuple(batch: dict) -> tuple:
    """``batch`` as Llama's forward takes it positionally (labels is its sixth parameter)."""
    return (batch["input_ids"], None, None, None, None, batch["labels"])


def bad_batches(tp: int) -> dict:
    import parallel3d

    rank = torch.distributed.get_rank()
    cfg = ds_config(2, 1, 2 // tp)
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp}
    engine, _, _, _ = parallel3d.initialize(model=make_tp_model("llama"), config=cfg)
    engine.train_batch(iter([_batch()]))
    before = {k: v.clone() for k, v in engine.full_parameters().items()}
    steps = engine.global_steps
    high = _batch()
    high["input_ids"][1, 5] = VOCAB
    on_rank_1 = high if rank == 1 else _batch()  # only one rank holds the bad batch
    negative_labels = _batch()
    negative_labels["labels"][0, 0] = -1
    packed = _batch(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2))  # two documents a row, no use_cache=False
    ignored = _batch()
    ignored["labels"][:, :3] = -100
    out = {
        "high_on_one_rank": _error(lambda: engine.train_batch(iter([on_rank_1]))),
        "negative_ids": _error(lambda: engine.eval_batch(iter([_batch(input_ids=torch.full((2, 8), -1))]))),
        "negative_labels": _error(lambda: engine.train_batch(iter([negative_labels]))),
        "empty": _error(lambda: engine.train_batch(iter([_batch(input_ids=torch.zeros(0, 8, dtype=torch.long))]))),
        "forward": _error(lambda: engine(**_batch(input_ids=torch.full((2, 8), VOCAB + 5)))),
        # a tuple is the forward's positional arguments: (input_ids, attention_mask, position_ids, cache,
        # inputs_embeds, labels)
        "tuple": _error(lambda: engine.train_batch(iter([as_tuple(high)]))),
        "list_labels": _error(lambda: engine.eval_batch(iter([list(as_tuple(negative_labels))]))),
        "forward_positional": _error(lambda: engine(torch.full((2, 8), VOCAB + 5))),
        # a direct call whose batch is bad on rank 1 only: rank 0 must not go on into the collectives
        "forward_on_rank_1": _error(lambda: engine(**on_rank_1)),
        "packed_on_rank_1": _error(lambda: engine(**(packed if rank == 1 else _batch()))),
    }
    after = engine.full_parameters()
    out["unchanged"] = engine.global_steps == steps and all(torch.equal(before[k], after[k]) for k in before)
    out["ignored_labels_train"] = isinstance(engine.train_batch(iter([ignored])), float)
    out["tuple_trains"] = isinstance(engine.train_batch(iter([as_tuple(ignored)])), float)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_token_ids_outside_the_vocabulary_stop_every_rank_before_the_forward(dist, tmp_path, tp):
    ranks = dist.run(2, bad_batches, tp, timeout=240)
    for rank, out in enumerate(ranks):
        assert out["high_on_one_rank"] == (
            "ConfigError: train_batch on rank 1: input_ids holds 127, outside the model's vocabulary: token ids must be "
            "in [0, 127), where 127 is the model config's vocab_size (a tokenizer larger than the model, or padding "
            "with -1?)"), out["high_on_one_rank"]
        assert out["negative_ids"].startswith("ConfigError: eval_batch on rank 0: input_ids holds -1, outside the "
                                              "model's vocabulary: token ids must be in [0, 127), where"), out
        assert out["negative_labels"].startswith(
            "ConfigError: train_batch on rank 0: labels holds -1, outside the model's vocabulary: token ids must be "
            "in [0, 127) or -100 (ignored), where"), out
        assert out["empty"] == ("ConfigError: train_batch on rank 0: input_ids is empty (shape [0, 8]); a micro-batch "
                                "needs at least one sequence of at least one token"), out
        assert out["forward"].startswith("ConfigError: engine(...) on rank 0: input_ids holds 132, outside"), out
        assert out["forward_on_rank_1"].startswith(
            "ConfigError: engine(...) on rank 1: input_ids holds 127, outside the model's vocabulary"), out
        assert out["packed_on_rank_1"].startswith(
            "ConfigError: engine(...) on rank 1: position_ids restart inside a row (packed documents) but use_cache is "
            "not False"), out
        assert out["tuple"] == (
            "ConfigError: train_batch on rank 0: input_ids (item 0 of the tuple) holds 127, outside the model's "
            "vocabulary: token ids must be in [0, 127), where 127 is the model config's vocab_size (a tokenizer "
            "larger than the model, or padding with -1?)"), out["tuple"]  # every rank holds "high": rank 0 is named
        assert out["list_labels"].startswith("ConfigError: eval_batch on rank 0: labels (item 5 of the list) holds -1, "
                                             "outside the model's vocabulary: token ids must be in [0, 127) or -100"), out
        assert out["forward_positional"].startswith("ConfigError: engine(...) on rank 0: input_ids holds 132, outside"), out
        assert out["unchanged"] and out["ignored_labels_train"] and out["tuple_trains"], (rank, out)


def test_batch_problem_without_a_process_group():
    model = make_tp_model("llama")
    assert vocab_size_of(model) == VOCAB and vocab_size_of(torch.nn.Linear(2, 2)) is None
    assert batch_problem(_batch(), VOCAB) is None
    assert batch_problem(_batch(labels=torch.full((2, 8), -100)), VOCAB) is None
    assert batch_problem(_batch(input_ids=torch.zeros(2, 0, dtype=torch.long)), VOCAB).startswith(
        "input_ids is empty (shape [2, 0])")
    assert batch_problem(_batch(input_ids=torch.rand(2, 8)), VOCAB) == (
        "input_ids has dtype float32; token ids must be integers")
    assert batch_problem(_batch(input_ids=torch.full((2, 8), 500)), None) is None  # no vocab known: range unchecked


def test_tuple_batches_are_read_by_the_forwards_parameter_names():
    names = positional_names(make_tp_model("llama"))
    assert names[:6] == ("input_ids", "attention_mask", "position_ids", names[3], "inputs_embeds", "labels")
    good, high = _batch(), _batch(input_ids=torch.full((2, 8), VOCAB))
    assert batch_problem(as_tuple(good), VOCAB, names) is None
    assert batch_problem(as_tuple(high), VOCAB, names).startswith("input_ids (item 0 of the tuple) holds 127, outside")
    assert batch_problem([good["input_ids"], torch.rand(2, 8)], VOCAB, names) is None  # item 1 is the attention mask
    assert batch_problem((good["input_ids"], None, None, None, None, torch.rand(2, 8)), VOCAB, names) == (
        "labels (item 5 of the tuple) has dtype float32; token ids must be integers")
    assert batch_problem(as_tuple(high), VOCAB, ()) is None  # a forward without named parameters: not read
    assert positional_names(torch.nn.Linear(2, 2)) == ("input",)


def _evaluate_on_rank_0_alone() -> float | None:
    """A no_grad forward on rank 0 only (ZeRO 2, no tp): it has no collective, so it must not wait
    for the other rank in a check of its batch."""
    import parallel3d
    from tests.tiny import make_model

    engine, *_ = parallel3d.initialize(model=make_model("llama"), config=ds_config(2, 1, 2))
    loss = None
    if torch.distributed.get_rank() == 0:
        with torch.no_grad():
            ids = torch.arange(16).view(2, 8)
            loss = float(engine(input_ids=ids, labels=ids).loss)
    torch.distributed.barrier()
    return loss


def test_an_evaluation_on_one_rank_does_not_wait_for_the_others(dist):
    losses = dist.run(2, _evaluate_on_rank_0_alone, timeout=120)
    assert losses[0] is not None and losses[1] is None
