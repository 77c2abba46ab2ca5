"""The front door loads its names on first use (parallel3d/__init__.py): ``zero3d``'s command
line and torchrun's agent (``parallel3d.launch.agent``) start without the engine, torch's
distributed checkpoint or transformers, an import every job and test pays per process."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import parallel3d

HEAVY = ("parallel3d.initialize", "parallel3d.engine.engine", "torch.distributed.checkpoint", "transformers")


def test_the_command_line_and_the_agent_import_no_engine():
    code = ("import sys, parallel3d.cli, parallel3d.launch.agent, parallel3d.launch.launcher\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_job_that_neither_resumes_nor_saves_loads_no_distributed_checkpoint(tmp_path):
    """``zero3d train``'s process and its workers import the job modules, initialize and the engine, and
    a fresh run's resume check finds nothing to resume; torch.distributed.checkpoint (~0.7 s CPU per
    process) is loaded by the first save or load only."""
    job = {"model": {"model_type": "llama"}, "engine": {"train_micro_batch_size_per_gpu": 1},
           "train": {"max_steps": 1, "output_dir": str(tmp_path / "run")}}
    code = ("import sys, parallel3d.cli, parallel3d.job.run, parallel3d.job.prepare, parallel3d.job.trainer\n"
            "import parallel3d.initialize, parallel3d.engine.engine\n"
            "from parallel3d.job.checkpoints import find_resume\n"
            "from parallel3d.job.config import load_job_config\n"
            f"assert find_resume(load_job_config({job!r})) is None\n"
            "print('torch.distributed.checkpoint' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out


def test_every_front_door_name_loads():
    from parallel3d import GatheredParameters, initialize, safe_set_full_grad

    assert all(getattr(parallel3d, name) is not None for name in parallel3d.__all__)
    assert GatheredParameters.__module__ == "parallel3d.compat.gathered"
    assert safe_set_full_grad.__module__ == "parallel3d.compat.param_access"
    assert isinstance(initialize, types.FunctionType) and initialize.__module__ == "parallel3d.initialize"
    with pytest.raises(AttributeError, match="no attribute 'initialise'"):
        parallel3d.initialise  # noqa: B018


def test_initialize_stays_the_function_when_its_module_is_bound():
    """The import system binds a submodule on its package when it first loads it (here: the
    first ``import parallel3d.initialize``, or unpickling the function): the package keeps the
    function of that name."""
    module = importlib.import_module("parallel3d.initialize")
    setattr(parallel3d, "initialize", module)
    assert parallel3d.initialize is module.initialize
