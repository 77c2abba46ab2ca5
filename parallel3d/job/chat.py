"""Chat data (``data.format: chat``): conversations rendered with the tokenizer's chat template,
labels on the assistant's turns only.

A row is either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the format of HF chat
datasets and TRL's conversational one) or ``{"prompt": ..., "completion": ...}``: two strings
(a user turn and the assistant's answer) or two lists of messages (TRL's conversational
prompt-completion). The conversation is rendered to text with ``tokenizer.apply_chat_template``
and tokenized once; a token is labelled (trained on) when it starts inside an assistant turn,
and -100 otherwise. An assistant turn's text is found by rendering prefixes of the conversation:
turn i spans from the end of ``messages[:i]`` rendered with the generation prompt (the template's
"assistant:" header) to the end of ``messages[:i + 1]``, so it holds the content and whatever
the template closes the turn with (``<|im_end|>``, EOS): the model learns to stop. This needs
a template whose rendering of a prefix is a prefix of the whole (true of the common ones); one
that rewrites earlier turns (dropping earlier reasoning, say) is refused with the row named.
"""

from __future__ import annotations

import logging
from typing import Any

from parallel3d.engine.batch_check import IGNORE_INDEX
from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

ROLES_TRAINED = ("assistant",)


def chat_columns(columns: list[str], split: str) -> list[str]:
    """The columns a chat split is read from; ConfigError naming the formats when it has neither."""
    pairs = ["prompt", "completion"] if "prompt" in columns and "completion" in columns else []
    if "messages" in columns or pairs:
        return (["messages"] if "messages" in columns else []) + pairs  # a file may mix the two kinds of row
    raise ConfigError(
        f'data.format "chat": the {split} split has no "messages" column (columns: {", ".join(columns)}); each '
        'JSONL line needs "messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, '
        '...], or "prompt" and "completion"')


def _as_messages(value: Any, role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ConfigError(f"{where} is {type(value).__name__}, not a string or a list of messages")


def conversation(row: dict, where: str) -> list[dict]:
    """The row's messages, checked: a non-empty list of {role, content} with an assistant turn."""
    if row.get("messages") is not None or row.get("prompt") is None or row.get("completion") is None:
        messages = row.get("messages")
        if not isinstance(messages, list):
            raise ConfigError(f'{where}: "messages" is {type(messages).__name__}, not a list of '
                              '{"role": ..., "content": ...} (or give "prompt" and "completion")')
    else:
        messages = (_as_messages(row["prompt"], "user", f'{where}: "prompt"')
                    + _as_messages(row["completion"], "assistant", f'{where}: "completion"'))
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise ConfigError(f'{where}: message {i} is {m!r}; each message needs a "role" and a "content" string')
    if not any(m["role"] in ROLES_TRAINED for m in messages):
        raise ConfigError(f"{where}: the conversation has no assistant turn, so nothing in it would be trained on")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]  # datasets fills absent keys with None


def chat_template_problem(tokenizer) -> str | None:
    """Why ``tokenizer`` cannot render chat data, or None."""
    if not getattr(tokenizer, "chat_template", None):
        return ("the tokenizer has no chat template (chat_template in tokenizer_config.json, or chat_template.jinja); "
                "data.format chat renders conversations with it: use a tokenizer that has one (tokenizer.path or "
                "model.path), or give tokenizer.chat_template (a Jinja template, or the path of a .jinja file)")
    if not getattr(tokenizer, "is_fast", False):
        return ("the tokenizer is a slow (Python) tokenizer; data.format chat needs a fast one (tokenizer.json), "
                "whose character offsets place the assistant's turns")
    return None


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    try:
        text = _render(tokenizer, messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] not in ROLES_TRAINED:
                continue
            head, turn = _render(tokenizer, messages[:i], generation_prompt=True), _render(tokenizer, messages[: i + 1])
            if not (turn.startswith(head) and text.startswith(turn)):
                raise ConfigError(
                    f"{where}: the chat template renders the conversation up to assistant turn {i} differently from "
                    "the start of the whole conversation (it rewrites earlier turns), so the assistant's tokens "
                    "cannot be told apart; use a template whose renderings of a conversation's prefixes are prefixes")
            spans.append((len(head), len(turn)))
    except ConfigError:
        raise
    except Exception as exc:  # jinja2's errors, and raise_exception() of a template (roles must alternate...)
        raise ConfigError(f"{where}: the chat template cannot render the conversation: {type(exc).__name__}: "
                          f"{exc}") from None
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation: labels are the ids inside assistant turns, else -100."""
    text, spans = assistant_spans(tokenizer, messages, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, labels, k = enc["input_ids"], [], 0
    for token, (start, _end) in zip(ids, enc["offset_mapping"]):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        labels.append(token if k < len(spans) and spans[k][0] <= start < spans[k][1] else IGNORE_INDEX)
    return ids, labels


def chat_texts(dataset, batch_size: int = 1000):
    """The contents of every message, for training the built-in tokenizer on chat data."""
    columns = dataset.column_names
    for batch in dataset.iter(batch_size=batch_size):
        for values in zip(*(batch[c] for c in columns)):
            for value in values:
                for m in ([{"content": value}] if isinstance(value, str) else value or []):
                    if isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"]:
                        yield m["content"]
