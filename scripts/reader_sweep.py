"""The model-code readers on every causal-LM type of the installed transformers, in one process.

    nice python scripts/reader_sweep.py [model_type ...] [--out FILE] [--counts FILE]

The cheap part of ``scripts/coverage.py``: no process group, no training. For each type's tiny
model (``coverage_check.tiny_model``, seed 0) it records three outcomes:

* ``pipeline``: ``models.pipeline_anatomy.pipeline_anatomy`` (the stage programs cut from the
  model's ``forward``): ``accepted`` or ``refused: <reason>``;
* ``loss_terms``: ``models.loss_terms.extra_loss_terms(...).check`` (the loss terms tensor
  parallelism adds to its token loss): ``accepted`` or ``refused: <reason>``;
* ``tp_head``: ``parallel3d.tensor_parallel.head_program`` (what tensor parallelism's forward
  reproduces between the base model and the loss): ``accepted`` or ``refused: <reason>``;
* ``init``: the init replay of the model built on the meta device (``models.materialize.InitReplay``,
  with its eager self-check) against the eager build, every tensor bit for bit: ``equal``,
  ``refused: <reason>`` (a ``MaterializeError``) or ``differs: <first tensor>`` (a bug).

Anything else a reader raises is ``error: <exception>`` (a bug: a reader must refuse with its
own error). A type whose tiny config does not build in transformers is ``skip``. One JSON line per
type goes to ``--out``; the counts per check are printed at the end (and written to ``--counts``).
Run it before and after a change to a reader, and against a new torch or transformers release
(docs/design.md, "Widening the tested versions").
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TIMEOUT_S = 120


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _accepts(run: Callable[[], Any], refusals: tuple[type, ...]) -> str:
    """``accepted``, or ``refused: <reason>`` when ``run`` raises one of the reader's ``refusals``."""
    try:
        run()
    except refusals as exc:
        return f"refused: {' '.join(str(exc).split())[:300]}"
    return "accepted"


def _pipeline(model: Any) -> str:
    from models.pipeline_anatomy import AnatomyError, pipeline_anatomy

    return _accepts(lambda: pipeline_anatomy(model), (AnatomyError,))


def _loss_terms(model: Any) -> str:
    from models.forward_source import SourceError
    from models.loss_terms import extra_loss_terms
    from models.tp_plans import TPPlanError, base_model_prefix

    return _accepts(lambda: extra_loss_terms(model, base_model_prefix(model)).check(model), (SourceError, TPPlanError))


def _tp_head(model: Any) -> str:
    from models.tp_plans import TPPlanError, base_model_prefix
    from parallel3d.errors import ConfigError
    from parallel3d.tensor_parallel.head_program import head_program

    return _accepts(lambda: head_program(model, base_model_prefix(model)).check(model), (ConfigError, TPPlanError))


def _init(model_type: str, eager: Any) -> str:
    import torch

    from coverage_check import tiny_model
    from models.materialize import InitReplay, MaterializeError

    with torch.device("meta"):
        meta = tiny_model(model_type)
    try:
        replay = InitReplay(meta, seed=0)
        got = dict(replay.read({n: [()] for n in replay.names()}))
    except MaterializeError as exc:
        return f"refused: {' '.join(str(exc).split())[:300]}"
    want = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    for name, (value,) in got.items():
        if name not in want:
            return f"differs: the replay names {name!r}, which the eager model does not have"
        if not torch.equal(value, want[name].detach()) and not (value.isnan().all() and want[name].isnan().all()):
            return f"differs: {name}"
    missing = [n for n in want if n not in got and n not in replay.aliases()]
    return f"differs: the replay lacks {missing[:3]}" if missing else "equal"


def sweep_one(model_type: str) -> dict[str, str]:
    import torch

    from coverage_check import tiny_model

    try:
        eager = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001 - the tiny config is not one transformers builds
        return {"skip": _line(exc)}
    out: dict[str, str] = {}
    for check, run in (("pipeline", lambda: _pipeline(tiny_model(model_type))),
                       ("loss_terms", lambda: _loss_terms(eager)), ("tp_head", lambda: _tp_head(eager)),
                       ("init", lambda: _init(model_type, eager))):
        signal.alarm(TIMEOUT_S)
        try:
            out[check] = run()
        except _Timeout:
            out[check] = f"error: no result within {TIMEOUT_S} s"
        except Exception as exc:  # noqa: BLE001 - a reader that does not refuse with its own error: a bug
            out[check] = f"error: {_line(exc)}"
        finally:
            signal.alarm(0)
            torch.set_default_device(None)
    return out


def counts(results: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = {}
    for outcomes in results.values():
        if "skip" in outcomes:
            table.setdefault("skip", Counter())["skip"] += 1
            continue
        for check, outcome in outcomes.items():
            table.setdefault(check, Counter())[outcome.split(":")[0]] += 1
    return {k: dict(v) for k, v in table.items()}


def main() -> None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*")
    parser.add_argument("--out", type=Path, default=Path("reader_sweep.jsonl"))
    parser.add_argument("--counts", type=Path)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    results: dict[str, dict[str, str]] = {}
    with args.out.open("w") as f:
        for model_type in args.types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            start = time.perf_counter()
            results[model_type] = sweep_one(model_type)
            f.write(json.dumps({"type": model_type, "outcomes": results[model_type],
                                "seconds": round(time.perf_counter() - start, 1)}) + "\n")
            f.flush()
    table = counts(results)
    print(json.dumps(table, indent=1))
    if args.counts:
        args.counts.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
