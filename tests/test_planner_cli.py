"""``zero3d plan`` and "auto" at initialize: arguments, errors, and what they choose.

The choices are checked against the planner itself (the same search on the same inputs), and
its ranking against its own predictions: every row fits the device memory, rows are ordered by
predicted step time, and pinning a value keeps only layouts with it.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from parallel3d.cli import main as zero3d
from parallel3d.errors import ConfigError
from parallel3d.planner.cli import parse_size
from tests.tiny import make_model

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    CONFIG.save_pretrained(path)
    return path


def _plan(capsys, *args) -> tuple[int, str, str]:
    code = zero3d(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("command", ["plan", "launch", "export", "plot", "simulate"])
def test_python_m_runs_the_module_as_zero3d_does(capsys, monkeypatch, command):
    """``python -m parallel3d.planner.cli ARGS`` is ``zero3d plan ARGS`` (and so for every module
    ``zero3d`` dispatches to): run as ``__main__`` it exits with what ``zero3d`` returns, printing
    the same. runpy runs the module as ``python -m`` does."""
    import runpy
    import warnings

    from parallel3d.cli import _DISPATCH

    want_code = zero3d([command, "--help"])
    want = capsys.readouterr().out
    module = _DISPATCH[command][0]
    monkeypatch.setattr("sys.argv", [module, "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as done:
        warnings.simplefilter("ignore", RuntimeWarning)  # the module is imported already (by zero3d)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert (done.value.code, capsys.readouterr().out) == (want_code, want)
    assert want_code == 0 and want.startswith(f"usage: zero3d {command}")


@pytest.mark.parametrize("text,value", [("80GB", 80e9), ("80 GiB", 80 * 2**30), ("81920MB", 81920e6), ("1.5tb", 1.5e12)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["80", "80XB", "-1GB", "GB", "0GB"])
def test_bad_sizes(text):
    with pytest.raises(ConfigError, match="--gpu-memory"):
        parse_size(text)


def test_ranked_layouts_fit_and_are_ordered(capsys, model_dir):
    """Checkpointing is pinned off: the checkpointed profiles (a split backward's recomputation the
    costliest of all) are the search's slowest part and are ranked by test_pins_and_hostfile."""
    code, out, err = _plan(capsys, model_dir / "config.json", "--gpus", 8, "--gpu-memory", "2GB", "--seq-len", 64,
                           "--global-batch", 16, "--checkpointing", "off", "--json", "--top", 50)
    assert code == 0, err
    rows = json.loads(out)
    assert rows and all(r["peak_gib"] <= 2e9 / 2**30 for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert len({r["layout"] for r in rows}) == len(rows)


def test_pins_and_hostfile(capsys, model_dir, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=2\nnode2 slots=2\n")
    code, out, err = _plan(capsys, model_dir, "--hostfile", hosts, "--gpu-memory", "2GB", "--seq-len", 64,
                           "--global-batch", 16, "--pp", 2, "--zero-stage", 1, "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert rows and all(r["layout"].startswith("pp2 ") and " z1 " in r["layout"] for r in rows)


def test_context_parallel_prices_both_methods(capsys, model_dir):
    """``--context-parallel 2``: the layouts at cp 2 (either method), and the #1's cp bytes per layer.
    Checkpointing is pinned off (its profiles are the costliest; cp does not change what it does)."""
    code, out, err = _plan(capsys, model_dir, "--gpus", 8, "--gpu-memory", "2GB", "--seq-len", 64,
                           "--global-batch", 16, "--tp", 1, "--context-parallel", 2, "--checkpointing", "off")
    assert code == 0, err
    assert '"context_parallel": {' in out and " cp2-" in out
    table = out[out.index("context parallelism 2 (per rank"):].splitlines()
    assert [line.split()[0] for line in table[2:4]] == ["ulysses", "ring"]


@pytest.mark.parametrize("args,message", [
    ([], "--gpus N or as --hostfile"),
    (["--gpus", 4, "--context-parallel", 0], '--context-parallel must be a positive integer or "auto", got \'0\''),
    (["--gpus", 0], "--gpus must be >= 1"),
    (["--gpus", 4, "--gpu-memory", "lots"], "--gpu-memory 'lots'"),
    (["--gpus", 4, "--efficiency", 2], "--efficiency must be in (0, 1]"),
    (["--gpus", 4, "--tp", 0], "--tp must be >= 1"),
])
def test_argument_errors(capsys, model_dir, args, message):
    code, _, err = _plan(capsys, model_dir, "--seq-len", 64, "--global-batch", 16, *args)
    assert code == 2 and message in err


def test_missing_model_and_nothing_fits(capsys, model_dir, tmp_path):
    code, _, err = _plan(capsys, tmp_path / "nope", "--gpus", 2, "--seq-len", 64, "--global-batch", 16)
    assert code == 2 and "no such file or directory" in err
    code, _, err = _plan(capsys, model_dir, "--gpus", 2, "--gpu-memory", "1MB", "--seq-len", 64, "--global-batch", 16)
    assert code == 1 and "none of the" in err and "fits 2 x" in err


def _auto_run(config: dict) -> dict:
    """On every rank: initialize with "auto" and report what was chosen, plus the planner's own pick.

    The pick is the one initialize's search returned (recorded around ``auto.choose``), not a second
    search: its inputs are checked against ones built here from the config (the workload, the
    hardware, the four open choices), and the search itself is deterministic."""
    from dataclasses import replace

    import torch.distributed as dist

    import parallel3d
    from parallel3d.config.config import Zero3DConfig
    from parallel3d.planner import auto
    from parallel3d.planner.hardware import cpu

    original, calls = auto.choose, []

    def recorded(planner, hw, choice):
        best, result = original(planner, hw, choice)
        calls.append((planner, hw, choice, best))
        return best, result

    auto.choose = recorded
    try:
        engine, _, _, _ = parallel3d.initialize(model=make_model("llama", num_hidden_layers=4), config=config)
    finally:
        auto.choose = original
    mesh, cfg = engine.mesh, engine.config
    (planner, hw, choice, best), = calls
    probe = {k: v for k, v in config.items() if k not in ("planner", "train_micro_batch_size_per_gpu")}
    probe.update(zero_optimization={"stage": 0}, tensor_parallel={"size": 1}, pipeline={"stages": 1})
    assert planner.workload == auto._workload(Zero3DConfig.from_dict(probe), 16)
    assert hw == replace(cpu(dist.get_world_size()), memory=parse_size(config["planner"]["device_memory"]))
    assert (choice.tp, choice.pp, choice.zero_stage, choice.micro_batch) == (None, None, None, None)
    assert next(planner.model.parameters()).is_meta and planner.config.num_hidden_layers == 4
    return {"chosen": (mesh.pp, mesh.tp, cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu,
                       cfg.gradient_accumulation_steps),
            "planner": (best.layout.pp, best.layout.tp, best.layout.zero_stage, best.layout.micro_batch)}


def test_auto_takes_the_planners_choice(dist):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "auto"},
              "tensor_parallel": {"size": "auto"}, "pipeline": {"stages": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "planner": {"seq_length": 16, "device_memory": "2000MB"}}
    results = dist.run(2, _auto_run, config)
    assert all(r == results[0] for r in results)  # every rank made the same choice
    pp, tp, stage, micro, gas = results[0]["chosen"]
    assert (pp, tp, stage, micro) == results[0]["planner"]
    assert micro * gas * (2 // (pp * tp)) == 8


@pytest.mark.parametrize("config,message", [
    ({"train_batch_size": 8, "tensor_parallel": {"size": "auto"}}, "needs the sequence length"),
    ({"train_batch_size": 8, "tensor_parallel": {"size": "auto"}, "planner": {"seq_length": 16, "gpus": 2}},
     "unknown config key 'planner.gpus'"),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "train_batch_size": 8,
      "planner": {"seq_length": 16}}, "needs train_batch_size and no gradient_accumulation_steps"),
    ({"train_batch_size": 8, "planner": {"seq_length": 16}}, "no \"auto\" value"),
    ({"train_batch_size": 8, "tensor_parallel": {"size": "auto"}, "planner": {"seq_length": 16, "device": "tpu"}},
     "planner.device: 'tpu' is not allowed"),
])
def test_auto_errors(config, message):
    import parallel3d

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **config}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallel3d.initialize(model=make_model("llama"), config=config)


@pytest.mark.parametrize("zero,frozen,message", [
    ({"mics_shard_size": 1}, False, "cannot be combined with zero_optimization.mics_shard_size 1"),
    ({}, True, "cannot be combined with frozen parameters"),
])
def test_auto_refuses_what_the_planner_does_not_price(zero, frozen, message):
    import parallel3d

    model = make_model("llama")
    model.get_input_embeddings().weight.requires_grad_(not frozen)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_batch_size": 8,
              "tensor_parallel": {"size": "auto"}, "planner": {"seq_length": 16},
              "zero_optimization": {"stage": 1, **zero}}
    with pytest.raises(ConfigError, match=message):
        parallel3d.initialize(model=model, config=config)


def test_a_config_without_auto_does_not_load_the_planner():
    """The planner's modules cost a rank ~2 MiB of RSS in initialize: loaded only for "auto"."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from parallel3d.planner.auto import resolve_auto; from tests.tiny import make_model\n"
        "cfg = {'train_batch_size': 8, 'tensor_parallel': {'size': 1}}\n"
        "assert resolve_auto(cfg, make_model('llama'), 1, torch.device('cpu')) == cfg\n"
        "print(sorted(m for m in sys.modules if m.startswith('parallel3d.planner.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "parallel3d.planner.predict" not in out and "parallel3d.planner.search" not in out, out


def test_a_first_run_prints_only_the_plan(model_dir, tmp_path):
    """No stored profiles: the profiles run (on worker processes), and the model's deprecation
    notices about how a profile calls it stay out of the output."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ZERO3D_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "parallel3d.cli", "plan", str(model_dir), "--gpus", "4", "--gpu-memory", "2GB",
            "--seq-len", "64", "--global-batch", "16", "--tp", "2", "--pp", "1", "--micro-batch", "2",
            "--zero-stage", "1", "--checkpointing", "off", "--sequence-parallel", "off"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("assuming 4 x "), done.stdout[:300]
    assert done.stdout.endswith("}\n")  # all of it, to the config snippet's end (zero3d plan ends with os._exit)
