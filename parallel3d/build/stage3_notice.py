"""At ZeRO stage 3, say once when the persistence threshold keeps most parameters whole.

``zero_optimization.stage3_param_persistence_threshold`` (DeepSpeed's default 100,000
elements) keeps every tensor below it whole on each data-parallel rank, gathered after each
step like stage 2, because fetching many small tensors per use costs more than they save. On a
small model that is nearly every tensor (a 4.5M-parameter Llama of hidden size 256: all of
them), so ``memory_report()`` shows no saving over stage 2 and a user concludes stage 3 does
not work. `persistence_notice` is the start-up line that says so, with the numbers and the key.
"""

from __future__ import annotations

from typing import Any

THRESHOLD_KEY = "zero_optimization.stage3_param_persistence_threshold"


def persistence_notice(optimizer: Any) -> str | None:
    """The line to log when stage 3 keeps more than half of this rank's parameters whole (else None).

    ``optimizer``: the engine's `zero.ZeroOptimizer` (its units, each persistent or sharded).
    Nothing is said on one data-parallel rank, where nothing is sharded at any stage.
    """
    settings = optimizer.settings
    if settings.stage != 3 or optimizer.dp.shard_world <= 1:
        return None
    units = optimizer.units
    total = sum(u.numel for u in units)
    whole = sum(u.numel for u in units if u.persistent)
    if total == 0 or 2 * whole <= total:
        return None
    tensors = sum(len(u.params) for u in units)
    whole_tensors = sum(len(u.params) for u in units if u.persistent)
    threshold = settings.param_persistence_threshold
    return (f"ZeRO stage 3 keeps {whole:,} of {total:,} parameters ({100 * whole / total:.0f}%; {whole_tensors} of "
            f"{tensors} tensors, each under {threshold:,} elements) whole on every data-parallel rank, as "
            f"{THRESHOLD_KEY} {threshold:,} asks, so their memory is not divided by the {optimizer.dp.shard_world} ranks "
            f"(memory_report() shows little saving over stage 2); lower {THRESHOLD_KEY} (0 shards every tensor) "
            "to shard them")
