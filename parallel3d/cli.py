"""The ``zero3d`` command: ``train``, ``launch``, ``export``, ``plot``, ``plan``, ``simulate``.

    zero3d train [CONFIG] [--nproc-per-node N] [--max-restarts N] [--print-config] [key.sub=value ...]
    zero3d launch ...   (parallel3d.launch.launcher)
    zero3d export ...   (parallel3d.export.export)
    zero3d plot ...     (parallel3d.job.plot)
    zero3d plan ...     (parallel3d.planner.cli)
    zero3d simulate ... (parallel3d.simulate.cli)

Each of those modules runs as ``python -m MODULE ...`` too, as its ``zero3d`` command does.

``zero3d train`` validates the whole job and prepares its tokenizer and packed data in this
process, so bad input stops here with one message, then starts N local workers through
torchrun (`parallel3d.launch.launcher.run_local`) running ``parallel3d.job.run``. With N = 1 it
trains in this process. For several machines use
``zero3d launch --hostfile hosts -m parallel3d.job.run CONFIG key=value ...``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

_DISPATCH = {
    "launch": ("parallel3d.launch.launcher", "run a training script on one or many nodes through torchrun"),
    "export": ("parallel3d.export.export", "write a checkpoint as a Hugging Face from_pretrained() directory"),
    "plot": ("parallel3d.job.plot", "draw a run's loss and validation curves as a PNG"),
    "plan": ("parallel3d.planner.cli", "the layouts of a model that fit a cluster, ranked by predicted step time"),
    "simulate": ("parallel3d.simulate.cli", "run one rank of a job alone (fake backend) and measure its memory"),
}

USAGE = """zero3d <command> [args]

commands:
  train    train a Hugging Face causal LM from a job config (no config: the built-in default)
{others}
'zero3d <command> --help' describes each."""


def train_parser() -> argparse.ArgumentParser:
    from parallel3d.launch.launcher import whole_number

    p = argparse.ArgumentParser(
        prog="zero3d train", allow_abbrev=False,
        description="Train a Hugging Face causal LM from a job config (YAML/JSON). Without CONFIG, the built-in "
                    "default: a small Llama on the CPython documentation, 2 local CPU processes, ZeRO stage 2.",
        epilog="overrides: key.sub=value, typed like YAML scalars, e.g. train.max_steps=200 "
               "engine.zero_optimization.stage=3 data.seq_len=256")
    p.add_argument("config", nargs="?", help="job config file (.yaml/.yml/.json); default: the built-in quickstart")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--nproc-per-node", type=whole_number(1), help="local worker processes (default: train.nproc_per_node)")
    p.add_argument("--max-restarts", type=whole_number(0), default=0,
                   help="after a worker dies, restart all workers up to this many times; they resume from the "
                        "latest checkpoint (default 0)")
    p.add_argument("--print-config", action="store_true", help="print the resolved job config and exit")
    return p


def _steps_done(prep) -> int | None:
    """The step of the checkpoint the job resumes from (from its default tag), if any."""
    import re

    match = re.fullmatch(r"global_step(\d+)", prep.resume_from.name) if prep.resume_from is not None else None
    return int(match[1]) if match else None


def train_main(argv: Sequence[str], as_program: bool = False) -> int:
    """``zero3d train``: validate and prepare here, then train in N local workers.

    ``as_program``: this is the ``zero3d`` process itself, which may end without teardown.
    """
    from parallel3d.job import run as job_run
    from parallel3d.job.stop import JobStopped

    args = train_parser().parse_intermixed_args(list(argv))
    positional = ([args.config] if args.config else []) + list(args.overrides)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "WORLD_SIZE" in os.environ:  # already a torchrun worker: be one
        return job_run.main(positional)
    job_run.setup_logging(0)
    try:
        config, overrides = job_run.split_args(positional)
        from parallel3d.job.config import load_job_config

        job = load_job_config(config, overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), end="")
            return 0
        nproc = args.nproc_per_node if args.nproc_per_node is not None else job.train.nproc_per_node
        from parallel3d.job.prepare import prepare

        prep = prepare(job, nproc)
        done = _steps_done(prep)
        if done is not None and done >= prep.total_steps:
            logger.info("nothing to train: %s is at step %d and the job asks for %d steps; raise train.max_steps "
                        "(or train.epochs) to continue it", prep.resume_from, done, prep.total_steps)
            return 0
        if nproc == 1 and not args.max_restarts:  # restarts need torchrun's agent, even for one worker
            from parallel3d.job.trainer import train

            train(prep)
            return 0
    except ConfigError as exc:
        print(f"zero3d train: error: {exc}", file=sys.stderr)
        return 2
    except (JobStopped, KeyboardInterrupt) as exc:
        return job_run.report_stop(exc, 0)
    from parallel3d.launch.launcher import run_local
    from parallel3d.runtime.lifeline import exit_now

    logger.info("starting %d local workers", nproc)
    code = run_local(["parallel3d.job.run", *positional], nproc, module=True, max_restarts=args.max_restarts)
    if as_program:  # the job is over: skip tearing down what prepare imported (seconds under load)
        exit_now(code)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zero3d`` console script; returns the exit code."""
    argv_given, argv = argv, list(sys.argv[1:] if argv is None else argv)
    others = "\n".join(f"  {name:<8} {text}" for name, (_, text) in _DISPATCH.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(others=others))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        try:
            return train_main(rest, as_program=argv_given is None)
        except SystemExit as exc:  # argparse: --help or a usage error, already printed
            return int(exc.code or 0)
    if command in _DISPATCH:
        module = importlib.import_module(_DISPATCH[command][0])
        code = int(module.main(rest) or 0)
        if command == "plan" and argv_given is None:  # printed: skip tearing down torch and the model (a second)
            from parallel3d.runtime.lifeline import exit_now

            exit_now(code)
        return code
    print(f"zero3d: unknown command {command!r}\n\n" + USAGE.format(others=others), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
