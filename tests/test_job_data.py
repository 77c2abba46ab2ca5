"""Data of `zero3d train`: bundled corpus, cached BPE, packing, seeded dp-sharded order, resume position."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from parallel3d import ConfigError
from parallel3d.job import tokenizer as tok_lib
from parallel3d.job.config import load_job_config
from parallel3d.job.corpus import pydoc_documents
from parallel3d.job.data import load_documents, pack_documents
from parallel3d.job.sampler import BlockSampler, TrainLoader, eval_batches

DOCS = [f"Document number {i} talks about {'spam ' * (i % 7)}and eggs." for i in range(60)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO3D_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def small_tokenizer():
    return tok_lib.train_bpe(DOCS * 3, 300)


def job_for(tmp_path, **data):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)))
    return load_job_config({
        "model": {"model_type": "llama"}, "engine": {"train_micro_batch_size_per_gpu": 1},
        "data": {"data_files": str(path), "seq_len": 16, **data}, "train": {"max_steps": 1, "seed": 7}})


# --- corpus and tokenizer ------------------------------------------------------------------------


def test_pydoc_corpus_is_real_english_and_fixed():
    docs = pydoc_documents()
    assert len(docs) > 100 and sum(map(len, docs)) > 300_000
    assert docs == pydoc_documents()
    assert any("statement" in d for d in docs)


def test_builtin_bpe_is_cached_and_round_trips(monkeypatch, cache):
    calls = []
    real = tok_lib.train_bpe
    monkeypatch.setattr(tok_lib, "train_bpe", lambda texts, v: calls.append(v) or real(texts, v))
    identity = {"corpus": "test"}
    a = tok_lib.builtin_tokenizer(iter(DOCS), identity, 300, 10**6)
    b = tok_lib.builtin_tokenizer(iter(DOCS), identity, 300, 10**6)
    assert calls == [300]  # the second one came from the cache
    assert len(list((cache / "tokenizers").iterdir())) == 1
    text = "Document number 3 talks about spam, ünïcödé and eggs."
    assert a.decode(a.encode(text)) == text and a.encode(text) == b.encode(text)
    assert a.eos_token == "<|endoftext|>" and len(a) <= 300


# --- packing -------------------------------------------------------------------------------------


def test_packing_concatenates_documents_with_eos_into_full_blocks(tmp_path, small_tokenizer):
    job = job_for(tmp_path, validation_fraction=0.0)
    docs, identity = load_documents(job)
    blocks, stats = pack_documents(docs, identity, small_tokenizer, job)
    ids = np.asarray(blocks["train"]["input_ids"])
    assert ids.shape == (stats["train"]["blocks"], 16) and blocks["validation"] is None
    eos = small_tokenizer.eos_token_id
    stream = [t for d in DOCS for t in small_tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]]
    assert stats["train"]["tokens"] == len(stream)
    assert ids.reshape(-1).tolist() == stream[: ids.size]  # packed in order, only the tail dropped
    assert len(stream) - ids.size < 16


def test_validation_fraction_holds_out_documents_by_seed(tmp_path, small_tokenizer):
    job = job_for(tmp_path, validation_fraction=0.2)
    docs, _ = load_documents(job)
    assert len(docs["validation"]) == 12 and len(docs["train"]) == 48
    assert set(docs["validation"]["text"]).isdisjoint(docs["train"]["text"])
    again, _ = load_documents(job)
    assert again["validation"]["text"] == docs["validation"]["text"]
    other = load_job_config({**job.model_dump(), "train": {**job.train.model_dump(), "seed": 8}})
    assert load_documents(other)[0]["validation"]["text"] != docs["validation"]["text"]


def test_saved_dataset_and_text_builder(tmp_path):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": DOCS}),
                          "dev": datasets.Dataset.from_dict({"body": DOCS[:5]})}).save_to_disk(str(saved))
    job = load_job_config({"model": {"model_type": "llama"}, "engine": {"train_micro_batch_size_per_gpu": 1},
                           "data": {"path": str(saved), "text_column": "body", "validation_split": "dev"},
                           "train": {"max_steps": 1}})
    docs, identity = load_documents(job)
    assert len(docs["train"]) == 60 and len(docs["validation"]) == 5 and identity["source"] == "disk"
    text = tmp_path / "lines.txt"
    text.write_text("\n".join(DOCS))
    job = load_job_config({"model": {"model_type": "llama"}, "engine": {"train_micro_batch_size_per_gpu": 1},
                           "data": {"data_files": str(text), "validation_fraction": 0}, "train": {"max_steps": 1}})
    docs, _ = load_documents(job)
    assert docs["train"]["text"] == DOCS  # text builder: one document per line


def test_packed_blocks_are_cached(tmp_path, cache, small_tokenizer):
    job = job_for(tmp_path, validation_fraction=0.2)
    docs, identity = load_documents(job)
    first, _ = pack_documents(docs, identity, small_tokenizer, job)
    entries = list((cache / "packed").iterdir())
    second, _ = pack_documents(docs, identity, small_tokenizer, job)
    assert list((cache / "packed").iterdir()) == entries and len(entries) == 1
    assert first["train"]["input_ids"] == second["train"]["input_ids"]


def test_splits_that_pack_into_no_block_are_one_message(tmp_path, small_tokenizer):
    """A split shorter than seq_len (the job would have died in datasets with an IndexError)."""
    job = job_for(tmp_path, validation_fraction=0.0, seq_len=2048)
    docs, identity = load_documents(job)
    for _ in range(2):  # the second time from the cache entry of the first
        with pytest.raises(ConfigError, match=r"^data: the train split \(60 document\(s\), \d+ tokens\) does not fill "
                                              r"one block of data.seq_len 2048 tokens; give more training text"):
            pack_documents(docs, identity, small_tokenizer, job)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "hi"}) + "\n")
    job = job_for(tmp_path, data_files={"train": str(tmp_path / "docs.jsonl"), "dev": str(short)},
                  validation_split="dev")
    docs, identity = load_documents(job)
    with pytest.raises(ConfigError, match=r"^data: the validation split \(1 document\(s\), \d+ tokens\) does not fill "
                                          r"one block of data.seq_len 16 tokens; .* or unset data.validation_split$"):
        pack_documents(docs, identity, small_tokenizer, job)


@pytest.mark.parametrize("content,reason", [
    (b"", "holds no documents (every file is empty)"),
    (b"\x81\xe8 random bytes \xff\x00" * 50, "the json builder cannot read {path}: ArrowInvalid: JSON parse error"),
    (b"[]", "the json builder cannot read {path}: it holds no documents"),
])
def test_empty_or_garbage_data_file_is_one_message(tmp_path, caplog, content, reason):
    path = tmp_path / "data.json"
    path.write_bytes(content)
    job = job_for(tmp_path, data_files=str(path))
    with pytest.raises(ConfigError) as err:
        load_documents(job)
    assert str(err.value).startswith(f"data.data_files: {reason.format(path=path)}" if "{path}" in reason else
                                     f"data.data_files: {path} {reason}"), str(err.value)
    assert not [r for r in caplog.records if r.name.startswith("datasets")]  # no second copy in the log


# --- order: seeded, sharded over dp only, resumable ---------------------------------------------


def read(sampler: BlockSampler, n: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(n)]


def test_ranks_read_disjoint_slices_of_one_global_order():
    n, micro, dp, gas = 103, 3, 2, 2
    ranks = [BlockSampler(n, micro, dp, r, gas, seed=5) for r in range(dp)]
    per_epoch = ranks[0].micro_per_epoch
    assert per_epoch == 103 // 6 // 2 * 2 == 16 and ranks[0].steps_per_epoch == 8
    reads = [read(s, per_epoch) for s in ranks]
    seen = [i for r in reads for batch in r for i in batch]
    assert len(seen) == len(set(seen)) == per_epoch * micro * dp  # each block at most once per epoch
    single = read(BlockSampler(n, micro * dp, 1, 0, gas, seed=5), per_epoch)
    for k in range(per_epoch):  # dp ranks split exactly the global micro-batch one rank would read
        assert reads[0][k] + reads[1][k] == single[k]


def test_order_fixed_by_seed_and_new_each_epoch():
    a, b, c = (BlockSampler(40, 2, 1, 0, 1, seed=s) for s in (1, 1, 2))
    epoch0 = read(a, a.micro_per_epoch)
    assert epoch0 == read(b, b.micro_per_epoch)
    assert epoch0 != read(c, c.micro_per_epoch)
    epoch1 = read(a, a.micro_per_epoch)
    assert a.epoch == 1 and epoch1 != epoch0 and sorted(sum(epoch1, [])) == list(range(40))


def test_resume_position_continues_at_the_exact_sample():
    full = BlockSampler(50, 2, 2, 1, 3, seed=9)
    expected = read(full, 40)  # crosses epoch boundaries (12 micro-batches per epoch)
    first = BlockSampler(50, 2, 2, 1, 3, seed=9)
    head = read(first, 27)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint's client_state holds
    resumed = BlockSampler(50, 2, 2, 1, 3, seed=9)
    resumed.load_state_dict(state)
    assert head + read(resumed, 13) == expected


def test_resume_refuses_a_changed_dataset_or_batch():
    state = BlockSampler(50, 2, 2, 0, 1, seed=9).state_dict()
    with pytest.raises(ConfigError, match="the checkpoint's num_blocks is 50 but this run's is 51"):
        BlockSampler(51, 2, 2, 0, 1, seed=9).load_state_dict(state)
    with pytest.raises(ConfigError, match="train_batch_size is 4 but this run's is 6"):
        BlockSampler(50, 3, 2, 0, 1, seed=9).load_state_dict(state)


def test_resume_with_another_data_parallel_size_reads_the_same_blocks_per_step():
    """dp 2 x micro 2 for 5 steps, then dp 1 x micro 4 (the same 12-block global batch) from the
    saved position: each step reads the blocks the uninterrupted dp-1 run reads, across an epoch end."""
    def steps(samplers, n):  # the set of blocks each optimizer step reads over all dp ranks
        return [sorted(b for s in samplers for _ in range(s.grad_accum) for b in s.next_indices()) for _ in range(n)]

    full = steps([BlockSampler(50, 4, 1, 0, 3, seed=9)], 9)
    ranks = [BlockSampler(50, 2, 2, r, 3, seed=9) for r in range(2)]
    head = steps(ranks, 5)
    resumed = BlockSampler(50, 4, 1, 0, 3, seed=9)
    resumed.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    assert head + steps([resumed], 4) == full


def test_too_few_blocks_for_one_step():
    with pytest.raises(ConfigError, match=r"has 7 blocks, fewer than one optimizer step needs .* = 8"):
        BlockSampler(7, 2, 2, 0, 2, seed=0)


def test_loader_and_eval_batches_yield_model_inputs():
    blocks = datasets.Dataset.from_dict({"input_ids": [[i] * 4 for i in range(10)]})
    loader = TrainLoader(blocks, BlockSampler(10, 2, 2, 1, 1, seed=0))
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 4) and batch["input_ids"].dtype.is_floating_point is False
    assert (batch["labels"] == batch["input_ids"]).all()
    per_rank = [[b["input_ids"][:, 0].tolist() for b in eval_batches(blocks, 2, 2, r, None)] for r in range(2)]
    assert per_rank == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert len(list(eval_batches(blocks, 2, 2, 0, 1))) == 1
