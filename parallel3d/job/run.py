"""Worker entry point of ``zero3d train``: ``python -m parallel3d.job.run [CONFIG] [key=value ...]``.

`zero3d train` starts this module under torchrun on each local process; it also runs as a
plain single process, or under ``zero3d launch -m parallel3d.job.run CONFIG`` on many nodes.
The first process of each node prepares the tokenizer and packed data (cached) while the
others wait, then they load them from the cache.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

import torch.distributed as dist

from parallel3d.errors import CollectiveError, ConfigError
from parallel3d.job.config import JobConfig, load_job_config
from parallel3d.job.metrics import TqdmHandler
from parallel3d.job.prepare import Prepared, prepare
from parallel3d.job.stop import JobStopped
from parallel3d.runtime.lifeline import die_with_agent, exit_now
from parallel3d.runtime.watchdog import backend_reason, is_collective_failure
from parallel3d.runtime.worker_errors import REPORTED_BY_RANK0

logger = logging.getLogger(__name__)


class ReportedElsewhere(ConfigError):
    """A ConfigError another rank has already printed."""


def setup_logging(rank: int) -> None:
    """INFO on rank 0 (through tqdm, so the bar stays whole), warnings elsewhere; quiet libraries."""
    handler = TqdmHandler()
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _agree(message: str | None) -> None:
    """Raise on every rank if any rank failed (so none waits in a collective for a dead peer)."""
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    failed = next((m for m in messages if m is not None), None)
    if failed is not None:
        raise (ConfigError if message is not None else ReportedElsewhere)(message or failed)


def prepare_all_ranks(job: JobConfig, world_size: int) -> Prepared:
    """`prepare` on the first process of each node, then (cache hits) on the others."""
    if not dist.is_initialized():
        return prepare(job, world_size)
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    prep, error = None, None
    for turn in (True, False):
        if first == turn:
            try:
                prep = prepare(job, world_size)
            except ConfigError as exc:
                error = str(exc)
        _agree(error)
    return prep


def run_job(job: JobConfig) -> dict:
    """Join the job's process group (torchrun's environment), prepare, train; returns the summary.

    Workers that torchrun restarted after a failure (``--max-restarts``) continue the run from
    its latest checkpoint, whatever ``train.resume`` says: the checkpoints are this run's own.
    """
    from parallel3d.config.config import Zero3DConfig
    from parallel3d.job.checkpoints import stored_checkpoints
    from parallel3d.job.config import engine_dict
    from parallel3d.job.resume_check import with_fallback
    from parallel3d.job.trainer import train
    from parallel3d.runtime.world import default_device, ensure_process_group

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        logger.info("torchrun restarted the workers after a failure (restart %d of %s); continuing from the "
                    "latest checkpoint", restart, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))
        if job.train.resume is False:
            job = job.model_copy(update={"train": job.train.model_copy(update={"resume": "auto"})})
    ensure_process_group(default_device(), Zero3DConfig.from_dict(engine_dict(job)).comm.timeout_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    prep = prepare_all_ranks(job, world)
    try:
        return train(prep)
    except ConfigError as exc:  # a damaged resume checkpoint: name the one to resume from instead
        if prep.resume_from is None or (dist.is_initialized() and dist.get_rank() != 0):
            raise
        hinted = with_fallback(exc, prep.resume_from, stored_checkpoints(prep.resume_from.parent))
        if hinted is exc:
            raise
        raise hinted from None


def split_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] [key=value ...] -> (config path or None, overrides)."""
    config, overrides = None, []
    for arg in argv:
        if "=" in arg and not os.path.isfile(arg):
            overrides.append(arg)
        elif config is None:
            config = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give one config file and key.sub=value overrides")
    return config, overrides


def report_stop(exc: JobStopped | KeyboardInterrupt, rank: int) -> int:
    """One line (rank 0 only) for a job stopped by a signal; returns the exit code."""
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C before training started
        exc = JobStopped(signal.SIGINT, 0, None)
    if rank == 0:
        print(f"zero3d train: {exc}", file=sys.stderr, flush=True)
    return exc.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    die_with_agent()
    setup_logging(rank)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config, overrides = split_args(sys.argv[1:] if argv is None else argv)
        run_job(load_job_config(config, overrides))
    except ReportedElsewhere:
        return 2
    except ConfigError as exc:
        if rank != 0 and getattr(exc, REPORTED_BY_RANK0, False):  # every rank raised it: rank 0 says it once
            return 2
        print(f"zero3d train: error: {exc}", file=sys.stderr)
        return 2
    except (JobStopped, KeyboardInterrupt) as exc:
        return report_stop(exc, rank)
    except CollectiveError as exc:  # each rank says what it saw: which operation, who did not arrive
        print(f"zero3d train: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # a peer lost while preparing, before the engine's watchdog exists
        if not is_collective_failure(exc):
            raise
        print(f"zero3d train: error: rank {rank}: a collective failed while the job was starting "
              f"({backend_reason(exc)})", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())
