"""The vocabulary of schedule tables: :class:`Kind` and :class:`Action`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Action", "Kind"]


class Kind(str, Enum):
    """What an action does. A ``str`` enum, so ``action.kind == "F"`` works."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)


@dataclass(frozen=True)
class Action:
    """One step of a rank's program.

    ``chunk`` is the local model chunk (0..V-1) the action belongs to: for a send, the chunk
    that produced the tensor; for a receive, the chunk that will consume it. ``peer`` is the
    other rank of a send or receive, ``None`` for compute.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        label = f"{self.kind.value}{self.microbatch}"
        if self.chunk:
            label += f".{self.chunk}"
        return label if self.peer is None else f"{label}@{self.peer}"
