"""Stopping a training job when told: at the next step boundary, on every rank together.

A stop signal (SIGTERM, SIGINT, SIGHUP) only sets a flag; after each optimizer step the ranks
agree (one all-reduce of the signal number, MAX) whether any rank received one, so they all
stop after the same step even when the signal reached one worker only. With
``train.save_on_signal`` they save a checkpoint first. A second Ctrl-C exits at once.

The flag is checked where the state is whole (no half-accumulated window, no save in
flight), which is what makes the checkpoint saved on the way out resumable exactly.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

import torch
import torch.distributed as dist

from parallel3d.runtime.lifeline import STOP_SIGNALS

logger = logging.getLogger(__name__)


class JobStopped(Exception):
    """Training ended early on a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        resume = (f"train.resume=auto continues from {checkpoint}" if checkpoint else
                  "no checkpoint to resume from (train.save_on_signal saves one on the way out)")
        super().__init__(f"stopped by {name} after step {step}; {resume}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Installs handlers for `STOP_SIGNALS` while it is entered (main thread only).

    ``received`` is the first signal's number (0: none). A second SIGINT (Ctrl-C twice) ends
    the process immediately with 130. A repeated SIGTERM or SIGHUP is absorbed: the job's own
    process tree sends those more than once when a parent dies (torchrun's agent forwards one,
    the kernel's parent-death signal brings another), and the stop is already under way.
    """

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received:
            if signum == signal.SIGINT:
                os._exit(128 + signum)
            return
        self.received = signum

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received (0: none); a collective over the whole world."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
