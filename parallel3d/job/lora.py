"""The `lora` section of a job: the meta-device model wrapped by ``peft.get_peft_model``.

The section's keys are ``peft.LoraConfig``'s; targets are checked against the model's module
names first, so a name that matches nothing is one message listing the names there are (peft
would raise its own error deep inside the wrapping). The wrapping runs on the meta device, so
it draws nothing; ``initialize`` draws the adapters (parallel3d/build/peft_meta.py) and reads the base
from model.path.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.job.config import JobConfig, LoraSection


def apply_lora(job: JobConfig, model: nn.Module) -> nn.Module:
    """``model`` as a ``PeftModel`` with the job's LoRA adapters; ``model`` itself without a lora section."""
    if job.lora is None:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora: the peft package is not installed (pip install peft)") from None
    check_targets(model, job.lora)
    config = LoraConfig(task_type="CAUSAL_LM", **job.lora.model_dump(exclude_none=True))
    with torch.device("meta"):
        return get_peft_model(model, config)


def check_targets(model: nn.Module, lora: LoraSection) -> None:
    """ConfigError for a target (or excluded) module name that matches no module of ``model``."""
    names = [n for n, _ in model.named_modules() if n]
    linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    known = f"its Linear layers are named {', '.join(linear)}" if linear else "it has no Linear layer"
    targets = lora.target_modules
    if isinstance(targets, str):
        if targets != "all-linear" and not any(re.fullmatch(targets, n) for n in names):
            raise ConfigError(f"lora.target_modules: the regular expression {targets!r} matches no module name of "
                              f"{type(model).__name__} (it must match a whole name such as "
                              f"{names[-1]!r}); {known}")
        return
    for key, entries in (("target_modules", targets), ("exclude_modules", lora.exclude_modules or [])):
        missing = [t for t in entries if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            raise ConfigError(f"lora.{key}: {', '.join(repr(t) for t in missing)} matches no module of "
                              f"{type(model).__name__}; {known} (or use \"all-linear\")")
