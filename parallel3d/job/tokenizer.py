"""The tokenizer: a local HF tokenizer directory, or the built-in byte-level BPE.

The built-in one is a GPT-2-style byte-level BPE (every string encodes, no unknown tokens)
trained with `tokenizers` on the job's training text and cached by a hash of that text's
identity and the vocabulary size; ``<|endoftext|>`` is its EOS (and BOS/PAD). It is a
`PreTrainedTokenizerFast`, so ``save_pretrained`` writes a directory `AutoTokenizer` loads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from parallel3d.errors import ConfigError
from parallel3d.job.cache import cached_dir, key_of
from parallel3d.build.remote_code import check_remote_code

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` learned from ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS)


def _capped(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for text in texts:
        if total >= max_chars:
            return
        text = text[: max_chars - total]
        total += len(text)
        yield text


def builtin_tokenizer(texts: Iterable[str], corpus_identity: dict, vocab_size: int, max_chars: int):
    """The cached built-in BPE for this corpus (trained now if it is not cached)."""
    from transformers import PreTrainedTokenizerFast

    key = key_of({"bpe": 1, "corpus": corpus_identity, "vocab_size": vocab_size, "max_chars": max_chars})

    def build(tmp: Path) -> None:
        logger.info("training a byte-level BPE tokenizer (vocab %d) on the training text", vocab_size)
        train_bpe(_capped(texts, max_chars), vocab_size).save_pretrained(tmp)

    path = cached_dir("tokenizers", key, build)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def local_tokenizer(path: str, key: str = "tokenizer.path", trust_remote_code: bool = False):
    """A tokenizer from a local directory; ConfigError naming ``key`` if it is not one."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f'{key}: "{path}" is not a directory')
    trust = check_remote_code(path, trust_remote_code, "tokenizer.trust_remote_code")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise ConfigError(f'{key}: "{path}" holds no tokenizer AutoTokenizer can load: {exc}') from None
    if tok.eos_token_id is None:
        raise ConfigError(f'{key}: the tokenizer in "{path}" has no EOS token, which packing puts between documents')
    return tok


def with_chat_template(tokenizer, template: str):
    """``tokenizer`` with ``template`` as its chat template: the Jinja text, or the path of a file holding it."""
    path = Path(template).expanduser()
    if "{" not in template and not path.is_file():
        raise ConfigError(f'tokenizer.chat_template: "{template}" is neither a Jinja template nor an existing file')
    tokenizer.chat_template = path.read_text() if "{" not in template else template
    return tokenizer


def has_tokenizer(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
