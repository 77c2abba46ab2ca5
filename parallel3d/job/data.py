"""Data: documents through `datasets`, a held-out validation split, tokenization and packing.

    docs = load_documents(job)                      # {"train": Dataset, "validation": Dataset | None}
    blocks = pack_documents(docs, tokenizer, job)   # same splits, one column input_ids of seq_len ids

Tokenization is ``map(batched=True)``; packing concatenates each batch of tokenized
documents with EOS after every document and cuts fixed blocks of ``seq_len`` (the tail of
each map batch that does not fill a block is dropped, as in HF's run_clm). Chat data
(``data.format: chat``) is rendered and labelled by `parallel3d.job.chat` and packed whole,
documents kept apart, by `parallel3d.job.packing`; its blocks also hold labels and
position_ids. Packed blocks are
cached (see `parallel3d.job.cache`) by a hash of the corpus identity (files, sizes, mtimes),
the split settings, the tokenizer and seq_len, so workers and later runs load them memory-mapped.
The training order is not decided here: see `parallel3d.job.sampler`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from itertools import chain

import numpy as np
from pathlib import Path

from parallel3d.engine.batch_check import IGNORE_INDEX
from parallel3d.errors import ConfigError
from parallel3d.job.cache import cached_dir, key_of
from parallel3d.job.chat import chat_columns, conversation, tokenize_conversation
from parallel3d.job.packing import has_trained_label, pack_whole
from parallel3d.job.config import JobConfig
from parallel3d.job.corpus import pydoc_documents, pydoc_identity

logger = logging.getLogger(__name__)

MAP_BATCH = 1000


def _files_of(spec, key: str) -> list[str]:
    """Existing local files of one data_files entry (paths or globs); ConfigError if one is missing."""
    out = []
    for pattern in [spec] if isinstance(spec, str) else spec:
        if "://" in pattern:
            raise ConfigError(f'{key}: "{pattern}" is a URL; zero3d train reads local files only')
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) if glob.has_magic(pattern) else (
            [os.path.expanduser(pattern)] if Path(os.path.expanduser(pattern)).exists() else [])
        if not matches:
            kind = "matches no file" if glob.has_magic(pattern) else "does not exist"
            raise ConfigError(f'{key}: "{pattern}" {kind} (relative paths are read from {os.getcwd()})')
        out.extend(matches)
    return out


def _stat(path: str) -> list:
    paths = [path] if os.path.isfile(path) else sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    return [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths]


def _raw_dataset(job: JobConfig):
    """(DatasetDict of the source, identity for cache keys)."""
    import datasets

    d = job.data
    source = d.source
    if source == "pydoc":
        ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": pydoc_documents()})})
        return ds, {"source": "pydoc", **pydoc_identity()}, "text"
    if source == "disk":
        if not Path(d.path).exists():
            raise ConfigError(f'data.path: "{d.path}" does not exist')
        try:
            ds = datasets.load_from_disk(d.path)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f'data.path: "{d.path}" is not a dataset saved with save_to_disk: {exc}') from None
        if isinstance(ds, datasets.Dataset):
            ds = datasets.DatasetDict({d.train_split: ds})
        return ds, {"source": "disk", "files": _stat(d.path)}, d.text_column
    if isinstance(d.data_files, dict):
        files = {split: _files_of(spec, f"data.data_files.{split}") for split, spec in d.data_files.items()}
        stats = {split: [s for f in fs for s in _stat(f)] for split, fs in files.items()}
    else:
        files = _files_of(d.data_files, "data.data_files")
        stats = [s for f in files for s in _stat(f)]
    flat = [f for fs in (files.values() if isinstance(files, dict) else [files]) for f in fs]
    if all(os.path.isfile(f) and os.path.getsize(f) == 0 for f in flat):
        raise ConfigError(f"data.data_files: {d.data_files} holds no documents (every file is empty)")
    datasets_log = logging.getLogger("datasets")
    level, datasets_log.level = datasets_log.level, logging.CRITICAL  # its own log repeats the error we raise
    try:
        ds = datasets.load_dataset(source, data_files=files)
    except Exception as exc:  # datasets raises many kinds for unreadable files
        raise ConfigError(f"data.data_files: the {source} builder cannot read {d.data_files}: {_reason(exc)}") from None
    finally:
        datasets_log.setLevel(level)
    return ds, {"source": source, "files": stats}, d.text_column


def _reason(exc: BaseException) -> str:
    """What went wrong: datasets wraps every builder error in "An error occurred while generating
    the dataset"; the exception it wraps says what (a JSON parse error, no rows at all)."""
    cause = exc.__cause__ or exc.__context__
    if "corresponds to no data" in str(exc) or type(cause).__name__ == "SchemaInferenceError":
        return "it holds no documents"  # an empty split, or no row to infer the columns from
    if type(exc).__name__ != "DatasetGenerationError" or cause is None:
        return str(exc)
    return f"{type(cause).__name__}: {cause}".splitlines()[0]


def load_documents(job: JobConfig) -> tuple[dict, dict]:
    """The train and validation documents (only the text column) and the corpus identity."""
    import datasets

    d = job.data
    ds, identity, column = _raw_dataset(job)
    splits = list(ds)
    if d.train_split not in ds:
        raise ConfigError(f'data.train_split: "{d.train_split}" is not a split of the dataset (splits: {", ".join(splits)})')
    if d.validation_split is not None and d.validation_split not in ds:
        raise ConfigError(f'data.validation_split: "{d.validation_split}" is not a split of the dataset '
                          f'(splits: {", ".join(splits)})')
    train = ds[d.train_split]
    if d.format == "chat":
        column = chat_columns(train.column_names, d.train_split)
        if d.validation_split is not None:
            chat_columns(ds[d.validation_split].column_names, d.validation_split)
    elif column not in train.column_names:
        raise ConfigError(f'data.text_column: "{column}" is not a column of the dataset '
                          f'(columns: {", ".join(train.column_names)})')
    if d.format == "text":
        feature = train.features[column]
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            raise ConfigError(f'data.text_column: column "{column}" holds {feature}, not text')
    if len(train) == 0:
        raise ConfigError(f'data: the "{d.train_split}" split has no documents')
    columns = column if isinstance(column, list) else [column]
    train = train.select_columns(columns)
    validation = None
    if d.validation_split is not None:
        validation = ds[d.validation_split].select_columns(columns)
    elif d.validation_fraction > 0:
        n_val = round(len(train) * d.validation_fraction)
        if n_val < 1 or n_val >= len(train):
            raise ConfigError(f"data.validation_fraction: {d.validation_fraction} of {len(train)} documents holds "
                              f"out {n_val}; need at least 1 and fewer than all")
        split = train.train_test_split(test_size=n_val, seed=job.train.seed, shuffle=True)
        train, validation = split["train"], split["test"]
    identity = {**identity, "text_column": column, "format": d.format, "train_split": d.train_split,
                "validation_split": d.validation_split, "validation_fraction": d.validation_fraction,
                "seed": job.train.seed if d.validation_split is None and d.validation_fraction > 0 else None}
    return {"train": train, "validation": validation, "column": column}, identity


def iter_texts(dataset, column: str):
    """Texts of a Dataset, streamed in batches."""
    for batch in dataset.iter(batch_size=MAP_BATCH):
        yield from (t for t in batch[column] if t)


def tokenizer_key(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return key_of({"tokenizer": text, "eos": tokenizer.eos_token_id})


def _tokenize_and_pack(dataset, column: str, tokenizer, seq_len: int, num_proc, fingerprint: str):
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        texts = [t or "" for t in batch[column]]
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids], "n": [len(x) + 1 for x in ids]}

    def pack(batch):
        flat = list(chain.from_iterable(batch["input_ids"]))
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, n, seq_len)]}

    tokens = dataset.map(tokenize, batched=True, batch_size=MAP_BATCH, remove_columns=dataset.column_names,
                         num_proc=num_proc, new_fingerprint=f"{fingerprint}-tok", desc="tokenize")
    n_tokens = int(tokens.data.column("n").to_numpy().sum()) if len(tokens) else 0
    blocks = tokens.map(pack, batched=True, batch_size=MAP_BATCH, remove_columns=tokens.column_names,
                        num_proc=num_proc, new_fingerprint=f"{fingerprint}-pack", desc="pack")
    return blocks, {"documents": len(dataset), "tokens": n_tokens, "blocks": len(blocks)}


def _chat_blocks(dataset, split: str, tokenizer, seq_len: int, num_proc, fingerprint: str):
    """Chat rows rendered, labelled on the assistant's turns and packed whole (with position_ids)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def render(batch, indices):
        rows = (dict(zip(batch, values)) for values in zip(*batch.values()))
        pairs = [tokenize_conversation(tokenizer, conversation(row, f"data: {split} row {i}"), f"data: {split} row {i}")
                 for i, row in zip(indices, rows)]
        return {"input_ids": [ids for ids, _ in pairs], "labels": [labels for _, labels in pairs],
                "n": [len(ids) for ids, _ in pairs], "trained": [sum(x != IGNORE_INDEX for x in lab[1:]) for _, lab in pairs],
                "untrained_after_cut": [not has_trained_label(lab[:seq_len]) for _, lab in pairs]}

    def pack(batch):
        blocks, _, _ = pack_whole(zip(batch["input_ids"], batch["labels"]), seq_len, pad)
        return {k: [b[k] for b in blocks] for k in ("input_ids", "labels", "position_ids")}

    docs = dataset.map(render, batched=True, batch_size=MAP_BATCH, with_indices=True, remove_columns=dataset.column_names,
                       num_proc=num_proc, new_fingerprint=f"{fingerprint}-chat", desc="render chat")
    lengths = docs.data.column("n").to_numpy() if len(docs) else np.zeros(0, dtype=np.int64)
    trained = int(docs.data.column("trained").to_numpy().sum()) if len(docs) else 0
    untrained = int(docs.data.column("untrained_after_cut").to_numpy().sum()) if len(docs) else 0
    blocks = docs.map(pack, batched=True, batch_size=MAP_BATCH, remove_columns=docs.column_names, num_proc=num_proc,
                      new_fingerprint=f"{fingerprint}-chat-pack", desc="pack whole")
    return blocks, {"documents": len(dataset), "tokens": int(lengths.sum()), "blocks": len(blocks),
                    "trained_tokens_before_cuts": trained, "cut_to_seq_len": int((lengths > seq_len).sum()),
                    "dropped_without_trained_labels": untrained}


def pack_documents(docs: dict, identity: dict, tokenizer, job: JobConfig) -> tuple[dict, dict]:
    """Packed blocks {"train": Dataset, "validation": Dataset | None} (cached) and their stats."""
    import datasets

    seq_len = job.data.seq_len
    chat = job.data.format == "chat"
    key = key_of({"packed": 1, "corpus": identity, "tokenizer": tokenizer_key(tokenizer), "seq_len": seq_len,
                  **({"chat": 2, "template": tokenizer.chat_template} if chat else {})})
    stats: dict = {}

    def build(tmp: Path) -> None:
        logger.info("tokenizing and packing %d training documents into blocks of %d tokens", len(docs["train"]), seq_len)
        out = {}
        for split in ("train", "validation"):
            if docs[split] is not None and chat:
                out[split], stats[split] = _chat_blocks(docs[split], split, tokenizer, seq_len, job.data.num_proc,
                                                        f"{key}-{split}")
            elif docs[split] is not None:
                out[split], stats[split] = _tokenize_and_pack(docs[split], docs["column"], tokenizer, seq_len,
                                                              job.data.num_proc, f"{key}-{split}")
        datasets.DatasetDict(out).save_to_disk(str(tmp))
        (tmp / "stats.json").write_text(json.dumps(stats))

    path = cached_dir("packed", key, build)
    stats = json.loads((path / "stats.json").read_text())
    held_out = ("unset data.validation_split" if job.data.validation_split is not None else
                "raise data.validation_fraction or set it to 0 (no validation)")
    for split, fix in (("train", "give more training text or lower data.seq_len"),
                       ("validation", f"give more validation text, lower data.seq_len, or {held_out}")):
        if split in stats and stats[split]["blocks"] == 0:  # datasets cannot load a split of zero rows
            s = stats[split]
            raise ConfigError(f"data: the {split} split ({s['documents']} document(s), {s['tokens']} tokens) does not "
                              f"fill one block of data.seq_len {seq_len} tokens; {fix}")
    packed = datasets.load_from_disk(str(path))
    blocks = {"train": packed["train"], "validation": packed["validation"] if "validation" in packed else None}
    return blocks, stats
