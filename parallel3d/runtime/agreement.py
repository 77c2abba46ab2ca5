"""Every rank must start with the same config, mesh and model: one small collective checks it.

A per-rank mix-up (ZeRO stage 2 on one rank and 3 on another, another accumulation count,
another model shape) otherwise trains silently wrong or ends in a backend abort far from its
cause. `agree` runs right after the process group exists, before any other collective:

1. each rank sends a digest of its description (or the ConfigError it hit validating its
   input, so a rank whose input is bad does not leave the others waiting in a collective);
2. if the digests differ, a second gather of the descriptions themselves names the first
   differences (up to three) and which ranks hold which value.

Every rank then raises the same `ConfigError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.runtime.worker_errors import reported_by_rank0

logger = logging.getLogger(__name__)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def describe(config: dict, mesh: dict[str, int], model: nn.Module) -> dict[str, Any]:
    """What must be equal on every rank: dotted config keys, mesh sizes, parameter names and shapes."""
    flat: dict[str, Any] = {}
    _flatten(config, "", flat)
    out = {f"config key {key}": value for key, value in flat.items()}
    out.update({f"mesh {dim}": size for dim, size in mesh.items()})
    out["model class"] = type(model).__name__
    for name, param in model.named_parameters():
        out[f"model parameter {name}"] = f"{list(param.shape)} {str(param.dtype).removeprefix('torch.')}" + (
            "" if param.requires_grad else " frozen")
    return out


def _digest(description: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def differences(descriptions: list[dict[str, Any]], most: int = 3) -> str:
    """The first ``most`` keys whose values differ between ranks, each with who holds what."""
    keys = list(dict.fromkeys(key for d in descriptions for key in d))
    found = []
    for key in keys:
        values = [d.get(key, "(absent)") for d in descriptions]
        if any(v != values[0] for v in values):
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(json.dumps(value, default=str), []).append(rank)
            found.append(f"{key}: " + ", ".join(f"{text} on {_ranks(ranks)}" for text, ranks in by_value.items()))
            if len(found) == most:
                break
    return "; ".join(found) if found else "(no difference in the descriptions, though their digests differ)"


def agree(error: ConfigError | None, description: dict[str, Any] | None,
          group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any rank's input was invalid or the ranks' descriptions differ.

    ``error`` is this rank's validation error (None: valid, and ``description`` is given).
    Without a process group there is nothing to compare: the error, if any, is raised.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = (str(error) if error is not None else None, _digest(description) if description is not None else None)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failed = [rank for rank, (message, _) in enumerate(gathered) if message is not None]
    if error is not None:
        rank0 = gathered[0][0] or f"rank {failed[0]} stopped: {gathered[failed[0]][0]}"  # what rank 0 raises
        raise reported_by_rank0(error) if str(error) in rank0 else error
    if failed:
        raise reported_by_rank0(ConfigError(f"rank {failed[0]} stopped: {gathered[failed[0]][0]}"))
    if len({digest for _, digest in gathered}) == 1:
        return
    descriptions: list = [None] * len(gathered)
    dist.all_gather_object(descriptions, description, group=group)
    raise reported_by_rank0(ConfigError(
        f"the ranks were started with different settings: {differences(descriptions)}; every rank must get the same "
        "config, mesh and model (a per-rank config file or environment mix-up?)"))


def raise_on_every_rank(error: ConfigError | None, device: torch.device,
                        group: dist.ProcessGroup | None = None) -> None:
    """Raise the first failing rank's error (same type and message) on every rank of ``group``.

    One all-reduce of a flag when no rank failed; the messages are gathered only when one did.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    failed = torch.tensor([int(error is not None)], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else (type(error), str(error)), group=group)
    kind, message = next(e for e in errors if e is not None)
    raise reported_by_rank0(kind(message))
