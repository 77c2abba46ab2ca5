"""A Zero3D config for the Trainer: TrainingArguments' values in place of ``"auto"``, as DeepSpeed's.

A DeepSpeed JSON written for ``TrainingArguments(deepspeed=...)`` says ``"auto"`` wherever the
Trainer's arguments should decide (transformers' ``HfTrainerDeepSpeedConfig``). The same JSON
works as ``zero3d_config=``: the same keys are filled from the same arguments, a value the
config states must agree with the argument (one ``ConfigError`` lists every mismatch, as
transformers raises one ValueError), and the keys a plain Trainer run depends on -- micro-batch
size, accumulation, gradient clipping, precision -- take the argument's value where the config
leaves them out, so a config of only ``zero_optimization`` trains as the plain Trainer would.

``"auto"`` on ``tensor_parallel.size``, ``pipeline.stages`` and ``zero_optimization.stage``
keeps Zero3D's meaning (the planner chooses, parallel3d/planner/auto.py).

The ``scheduler`` section is held back: its ``total_num_steps`` and ``warmup_num_steps`` are
known only when ``train()`` has counted the steps (`scheduler_section`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from pydantic import ValidationError

from parallel3d.config.config import read_config_file
from parallel3d.config.sections import SchedulerConfig, describe_validation_error
from parallel3d.errors import ConfigError

_MISSING = object()


def _node(data: dict, dotted: str) -> tuple[dict | None, str]:
    """The dict holding the last key of ``dotted`` (None where a section on the way is absent)."""
    *path, key = dotted.split(".")
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, key
    return (node, key) if isinstance(node, dict) else (None, key)


class _Filler:
    """transformers' ``fill_match``: replace ``"auto"``, else record a disagreeing value."""

    def __init__(self, data: dict) -> None:
        self.data = data
        self.mismatches: list[str] = []

    def fill(self, dotted: str, value: Any, argument: str, *, default: bool = False, must_match: bool = True) -> None:
        node, key = _node(self.data, dotted)
        if node is None:
            return
        current = node.get(key, _MISSING)
        if current == "auto" or (current is _MISSING and default):
            node[key] = value
        elif current is not _MISSING and must_match and current != value:
            self.mismatches.append(f"{dotted}={current!r} but TrainingArguments {argument}={value!r}")


def _as_dict(source: Any) -> dict:
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        return read_config_file(source)
    raise ConfigError(f"zero3d_config must be a config dict or the path of a .json/.yaml file, got "
                      f"{type(source).__name__}")


def _hidden_size(model: Any) -> int | None:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else max(getattr(config, "hidden_sizes", None) or [0]) or None


def _fill_by_hidden_size(data: dict, model: Any) -> None:
    """transformers' ``trainer_config_finalize``: bucket sizes and the persistence threshold from the
    model's hidden size, where the config says "auto"."""
    zero = data.get("zero_optimization")
    keys = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
            "stage3_param_persistence_threshold": lambda h: 10 * h}
    wanted = [k for k in keys if isinstance(zero, dict) and zero.get(k) == "auto"]
    if not wanted:
        return
    hidden = _hidden_size(model)
    if hidden is None:
        raise ConfigError(f"zero_optimization.{wanted[0]} is \"auto\", which is filled from the model's hidden_size, "
                          "and the model's config has none; give a number")
    for key in wanted:
        zero[key] = keys[key](hidden)


def trainer_config(source: Any, args: Any, model: Any = None) -> tuple[dict, dict | None]:
    """The config dict for ``initialize`` and the held-back ``scheduler`` section (or None)."""
    data = _as_dict(source)
    _fill_by_hidden_size(data, model)
    if data.get("train_batch_size") == "auto":
        del data["train_batch_size"]  # Zero3D derives it from the micro-batch, accumulation and dp size
    filler = _Filler(data)
    filler.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size",
                default=True)
    filler.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps",
                default=True)
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm", default=True)
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0, "(none)", must_match=False)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    for precision, on in (("fp16", args.fp16 or args.fp16_full_eval), ("bf16", args.bf16 or args.bf16_full_eval)):
        if on and not isinstance(data.get(precision), dict):
            data[precision] = {"enabled": True}  # the Trainer's argument turns the precision on
        filler.fill(f"{precision}.enabled", bool(on), f"{precision}|{precision}_full_eval")
    if filler.mismatches:
        raise ConfigError("zero3d_config disagrees with TrainingArguments: " + "; ".join(filler.mismatches)
                          + ' (write "auto" for these keys to take the Trainer\'s values)')
    return data, data.pop("scheduler", None)


def scheduler_section(section: dict, args: Any, num_training_steps: int) -> SchedulerConfig:
    """The held-back ``scheduler`` section with its step counts filled, validated."""
    data = copy.deepcopy(section)
    filler = _Filler(data)
    filler.fill("params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    filler.fill("params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    if filler.mismatches:
        raise ConfigError("zero3d_config's scheduler disagrees with the Trainer: " + "; ".join(
            m.replace("params.", "scheduler.params.", 1) for m in filler.mismatches))
    try:
        return SchedulerConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, SchedulerConfig, prefix="scheduler")) from None
