"""Chat data in ``zero3d train`` (``data.format: chat``): assistant-only labels, whole documents
packed apart, the refusals. The loss's token mean over layouts is tests/test_token_mean.py's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from parallel3d.errors import ConfigError
from parallel3d.job import tokenizer as tok_lib
from parallel3d.job.chat import tokenize_conversation
from parallel3d.job.config import load_job_config
from parallel3d.job.packing import pack_whole
from parallel3d.job.sampler import model_batch

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a list?"},
     {"role": "assistant", "content": "An ordered, mutable sequence."},
     {"role": "user", "content": "And a tuple?"}, {"role": "assistant", "content": "An immutable one."}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}],
]
PAIRS = [{"prompt": "Say hi.", "completion": "Hi!"}, {"prompt": "Count to two.", "completion": "One, two."}]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO3D_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def chat_tokenizer():
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["<|im_start|>user\n<|im_end|>\n"] * 20
    tok = tok_lib.train_bpe(texts, 400)
    tok.chat_template = CHATML
    return tok


def test_prompt_tokens_are_labelled_minus_100(chat_tokenizer):
    """Only the assistant's turns (with the template's end of turn) are trained on, in every turn."""
    ids, labels = tokenize_conversation(chat_tokenizer, CONVERSATIONS[0], "row 0")
    text = chat_tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert chat_tokenizer.decode(ids) == text
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert all(label in (-100, i) for i, label in zip(ids, labels))
    assert chat_tokenizer.decode(trained) == "An ordered, mutable sequence.<|im_end|>\nAn immutable one.<|im_end|>\n"
    prompt_end = text.index("An ordered")
    prompt_tokens = len(chat_tokenizer(text[:prompt_end], add_special_tokens=False)["input_ids"])
    assert labels[:prompt_tokens] == [-100] * prompt_tokens  # system, user and the assistant header


def _packed_pairs(tmp_path, tokenizer, pairs: list[dict], seq_len: int) -> tuple[dict, dict]:
    """Prompt/completion rows through the job's loading and packing (blocks and stats)."""
    from parallel3d.job.data import load_documents, pack_documents

    files = tmp_path / "pairs.jsonl"
    files.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    job = load_job_config({"model": {"model_type": "llama"}, "engine": {"train_micro_batch_size_per_gpu": 1},
                           "data": {"data_files": str(files), "format": "chat", "seq_len": seq_len,
                                    "validation_fraction": 0},
                           "train": {"max_steps": 1}})
    docs, identity = load_documents(job)
    return pack_documents(docs, identity, tokenizer, job)


def test_prompt_completion_pairs_are_a_user_and_an_assistant_turn(tmp_path, chat_tokenizer):
    blocks, stats = _packed_pairs(tmp_path, chat_tokenizer, PAIRS, 256)
    row = blocks["train"][0]
    trained = [i for i, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert chat_tokenizer.decode(trained) == "Hi!<|im_end|>\nOne, two.<|im_end|>\n"
    assert stats["train"]["documents"] == 2 and stats["train"]["blocks"] == 1


def test_whole_documents_packed_with_positions_restarting():
    a, b, c = ([1, 2, 3], [1, 2, 3]), ([4, 5], [-100, 5]), ([6] * 9, [6] * 9)
    blocks, cut, dropped = pack_whole([a, b, c], 8, pad_id=0)
    assert cut == 1 and dropped == 0 and len(blocks) == 2
    assert blocks[0] == {"input_ids": [1, 2, 3, 4, 5, 0, 0, 0], "labels": [-100, 2, 3, -100, 5, -100, -100, -100],
                         "position_ids": [0, 1, 2, 0, 1, 0, 1, 2]}
    assert blocks[1] == {"input_ids": [6] * 8, "labels": [-100] + [6] * 7, "position_ids": list(range(8))}


def test_documents_without_a_trained_label_after_the_cut_are_dropped():
    """A conversation cut before its assistant turn (or with none) would make a block of -100 labels,
    whose mean loss is 0/0 = NaN under loss_normalization "micro_batch": it is dropped and counted."""
    kept = ([1, 2, 3], [-100, 2, 3])
    late_answer = ([4] * 6 + [5, 6], [-100] * 6 + [5, 6])  # the answer starts after the cut at 4
    first_label_only = ([7, 8], [7, -100])  # a block's first label of a document is always -100
    blocks, cut, dropped = pack_whole([late_answer, kept, first_label_only], 4, pad_id=0)
    assert (cut, dropped) == (1, 2)
    assert blocks == [{"input_ids": [1, 2, 3, 0], "labels": [-100, 2, 3, -100], "position_ids": [0, 1, 2, 0]}]


def test_chat_stats_count_the_dropped_conversations(tmp_path, chat_tokenizer):
    long_prompt = {"prompt": " ".join(["Count to two."] * 40), "completion": "One, two."}
    blocks, stats = _packed_pairs(tmp_path, chat_tokenizer, [long_prompt, *PAIRS], 64)
    assert stats["train"]["cut_to_seq_len"] == 1 and stats["train"]["dropped_without_trained_labels"] == 1
    assert all(any(label != -100 for label in row["labels"]) for row in blocks["train"])
    trained = [i for row in blocks["train"] for i, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert chat_tokenizer.decode(trained) == "Hi!<|im_end|>\nOne, two.<|im_end|>\n"


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss of each labelled position (label t predicted at t - 1), in order."""
    shifted = labels[..., 1:].reshape(-1)
    losses = torch.nn.functional.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]), shifted,
                                               ignore_index=-100, reduction="none")
    return losses[shifted != -100]


def _two_documents(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in (7, 6):
        ids = torch.randint(1, 96, (n,), generator=g).tolist()
        labels = [-100, -100] + ids[2:]  # a prompt of two tokens
        docs.append((ids, labels))
    return docs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_give_the_losses_of_separate_runs(kind, attn):
    """float64: two documents in one packed row (with padding) give each token the loss it has
    when each document runs alone, so attention and positions do not cross documents."""
    from tests.tiny_pp import make_pp_model

    model = make_pp_model(kind, attn=attn).double()
    docs = _two_documents()
    blocks, _, _ = pack_whole(docs, 16, pad_id=0)
    batch = model_batch({k: [blocks[0][k]] for k in blocks[0]})
    packed = _token_losses(model(**batch).logits, batch["labels"])
    alone = torch.cat([_token_losses(model(input_ids=torch.tensor([ids]), use_cache=False).logits,
                                     torch.tensor([labels])) for ids, labels in docs])
    assert packed.shape == alone.shape == (5 + 4,)
    # float64, but HF's eager attention takes its softmax (and Llama its RMS norm) in float32: a few
    # float32 ulps where the row's length differs; a document that sees another is off by 1e-2 and more
    torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-9)
    leaky = {k: v for k, v in batch.items() if k != "use_cache"}  # transformers' cache skips the packed mask
    assert not torch.allclose(_token_losses(model(**leaky).logits, batch["labels"]), alone)


def _packed_loss_on_layout(tp: int, pp: int, cp: int = 1, method: str = "ring") -> tuple[float, float]:
    """eval_batch's token-mean loss of packed rows on a tp/pp/cp layout, and the same documents run alone."""
    import parallel3d
    from tests.float64_loss import install
    from tests.tiny_pp import make_pp_model

    install()
    model = make_pp_model("llama")
    rows = [pack_whole(_two_documents(seed), 16, pad_id=0)[0][0] for seed in range(2)]
    docs = [d for seed in range(2) for d in _two_documents(seed)]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        total = sum(_token_losses(reference(input_ids=torch.tensor([i]), use_cache=False).logits,
                                  torch.tensor([lab])).sum() for i, lab in docs)
    count = sum(sum(label != -100 for label in lab[1:]) for _, lab in docs)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "loss_normalization": "tokens", "tensor_parallel": {"size": tp}, "pipeline": {"stages": pp},
              "context_parallel": {"size": cp, "method": method},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = parallel3d.initialize(model=model, config=config)
    engine.eval()
    loss = engine.eval_batch(iter([model_batch({k: [row[k]] for k in row}) for row in rows]))
    return loss, (total / count).item()


@pytest.mark.parametrize("tp,pp,cp,method", [(2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, "ring"),
                                              (1, 1, 2, "ulysses")])
def test_packed_documents_stay_apart_under_tp_pp_and_cp(dist, tp, pp, cp, method):
    """The job's packed blocks (documents, then padding as a document of its own) under context
    parallelism too: each rank holds half of every block (ring: two of its four chunks)."""
    for got, want in dist.run(tp * pp * cp, _packed_loss_on_layout, tp, pp, cp, method or "ring"):
        assert got == pytest.approx(want, rel=1e-5)


# --- bad inputs ----------------------------------------------------------------------------------


def _chat_job(tmp_path, rows, **sections) -> dict:
    files = tmp_path / "chat.jsonl"
    files.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = {"model": {"model_type": "llama", "config": {"hidden_size": 32, "intermediate_size": 64,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}},
           "tokenizer": {"vocab_size": 300},
           "data": {"data_files": str(files), "format": "chat", "seq_len": 64, "validation_fraction": 0},
           "engine": {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
           "train": {"max_steps": 1, "output_dir": str(tmp_path / "run")}}
    for name, value in sections.items():
        job[name] = {**job[name], **value}
    return job


def _error(job: dict) -> str:
    from parallel3d.job.prepare import prepare

    with pytest.raises(ConfigError) as info:
        prepare(load_job_config(job), 1)
    return str(info.value)


def test_chat_file_without_messages(tmp_path):
    message = _error(_chat_job(tmp_path, [{"text": "no conversation here"}]))
    assert message.startswith('data.format "chat": the train split has no "messages" column (columns: text); each '
                              'JSONL line needs "messages"')


def test_tokenizer_without_chat_template(tmp_path):
    message = _error(_chat_job(tmp_path, [{"messages": c} for c in CONVERSATIONS]))
    assert message.startswith('data.format "chat": the tokenizer has no chat template')
    assert "tokenizer.chat_template" in message


def test_a_bad_row_is_named(tmp_path):
    rows = [{"messages": CONVERSATIONS[1]}, {"messages": [{"role": "user", "content": "only a question"}]}]
    message = _error(_chat_job(tmp_path, rows, tokenizer={"chat_template": CHATML}))
    assert message == "data: train row 1: the conversation has no assistant turn, so nothing in it would be trained on"


def test_packing_refused_where_attention_would_cross_documents(tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS]
    message = _error(_chat_job(tmp_path, rows, tokenizer={"chat_template": CHATML},
                               model={"model_type": "opt", "config": {"hidden_size": 32, "ffn_dim": 64,
                                                                      "num_hidden_layers": 1,
                                                                      "num_attention_heads": 2}}))
    assert message.startswith('data.format "chat" packs conversations into blocks, each attending only to itself: '
                              "OPTForCausalLM builds its attention mask without position_ids")


def test_flash_attention_needs_one_row_per_micro_batch():
    from models.packed_attention import packing_problem
    from tests.tiny import make_model

    model = make_model("llama")
    assert "train_micro_batch_size_per_gpu is 2" in packing_problem(model, "flash_attention_2", 2)
    assert packing_problem(model, "flash_attention_2", 1) is None
    assert packing_problem(model, "sdpa", 8) is None
    assert 'attention implementation "paged|sdpa" is not known' in packing_problem(model, "paged|sdpa", 1)


def test_chat_job_trains_with_the_token_mean(tmp_path):
    from parallel3d.job.run import run_job

    rows = [{"messages": c} for c in CONVERSATIONS] * 8 + [{"prompt": p["prompt"], "completion": p["completion"]}
                                                         for p in PAIRS] * 8
    job = load_job_config(_chat_job(tmp_path, rows, tokenizer={"chat_template": CHATML},
                                    train={"max_steps": 4, "progress": False}, data={"validation_fraction": 0.1}))
    from parallel3d.job.config import engine_dict

    assert engine_dict(job)["loss_normalization"] == "tokens"
    summary = run_job(job)
    records = [r for r in summary["records"] if "loss" in r]
    assert len(records) == 4 and all(r["loss"] > 0 for r in records)


def test_engine_refuses_packed_rows_that_a_cache_would_join():
    """Packed position_ids without use_cache=False: transformers would make a cache and drop the
    packed-document mask, so the engine stops (train_batch and engine(...) alike)."""
    import parallel3d
    from tests.tiny import ds_config, make_model

    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config=ds_config(0, 1, 1))
    block = pack_whole(_two_documents(), 16, pad_id=0)[0][0]
    batch = model_batch({k: [block[k]] * 2 for k in block})
    leaky = {k: v for k, v in batch.items() if k != "use_cache"}
    with pytest.raises(ConfigError, match="position_ids restart inside a row .* pass use_cache=False"):
        engine.train_batch(iter([leaky]))
    with pytest.raises(ConfigError, match="position_ids restart inside a row"):
        engine(**leaky)
    assert engine.train_batch(iter([batch])) > 0


def test_validation_loss_is_the_token_mean_of_the_split():
    """evaluate() weights each window by its label tokens under the token mean: the loss of the whole
    validation split, whatever its windows hold."""
    import datasets

    import parallel3d
    from parallel3d.job.trainer import evaluate
    from tests.tiny import ds_config, make_model

    model = make_model("llama")
    rows = [pack_whole(_two_documents(seed), 16, pad_id=0)[0][0] for seed in range(3)]
    rows[2]["labels"] = [-100] * 14 + rows[2]["labels"][14:]  # windows with very different label counts
    blocks = datasets.Dataset.from_list(rows)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        losses = torch.cat([_token_losses(reference(**model_batch({k: [r[k]] for k in r})).logits,
                                          torch.tensor([r["labels"]])) for r in rows])
    engine, _, _, _ = parallel3d.initialize(model=model, config={**ds_config(0, 2, 1), "train_batch_size": 4,
                                                                  "loss_normalization": "tokens"})
    assert evaluate(engine, blocks, 1, None) == pytest.approx(losses.mean().item(), rel=1e-6)


def test_validation_without_label_tokens_is_refused():
    """Under the token mean a validation split with no label token has no loss: one clear error, not 0/0."""
    import datasets

    import parallel3d
    from parallel3d.job.trainer import evaluate
    from tests.tiny import ds_config, make_model

    rows = [pack_whole(_two_documents(seed), 16, pad_id=0)[0][0] for seed in range(2)]
    for row in rows:
        row["labels"] = [-100] * len(row["labels"])
    engine, _, _, _ = parallel3d.initialize(model=make_model("llama"), config={
        **ds_config(0, 2, 1), "train_batch_size": 4, "loss_normalization": "tokens"})
    with pytest.raises(ConfigError, match="validation: no block of the validation split has a label token"):
        evaluate(engine, datasets.Dataset.from_list(rows), 1, None)
