"""Compiled blocks (``compile: {"enabled": true}``, parallel3d/build/compiled_blocks.py) against eager.

Each distributed case trains the same tiny model twice on every rank, eagerly and with its
blocks compiled, over several steps, and holds the compiled run to the eager one: the losses
and the final parameters to 1e-5. Dynamo's counters (``compile_counts``, deltas over the
compiled run) must show a graph made, no graph break, and no frame compiled after step 2 (no
recompilation); one graph serves every block of a rank. ``torch._dynamo.reset()`` starts each
case afresh (the worker processes are shared by the session; a cache filled by an earlier case
would hide a recompilation, or reach dynamo's limit of 8 entries per function and run eager).

Inductor (CPU, gcc) compiles one case of each key path: ZeRO-3's gather/release hooks, tensor
parallelism's collectives, pipeline stages. The other cases use "aot_eager", which traces and
partitions forward and backward as inductor does (the graph breaks and recompilations are
dynamo's either way) but skips the C++ build, minutes on two shared cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import ds_config, make_model, max_rel_param_error, rank_micro_batches, token_batches

STEPS = 4
RTOL = 1e-5


def _train(kind: str, config: dict, compiled: dict | None, layers: int, by_method: bool = False,
           hf_checkpointing: bool = False):
    """Losses, full parameters and the counters after each step, on this rank."""
    import torch.distributed as dist

    import parallel3d
    from parallel3d.build.compiled_blocks import compile_counts

    gas = config["gradient_accumulation_steps"]
    model, vocab = _model(kind, layers)
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled and not by_method:
        config = dict(config, compile={"enabled": True, **compiled})
    engine, *_ = parallel3d.initialize(model=model, config=config)
    if compiled and by_method:
        engine.compile(backend=compiled["backend"], compile_kwargs=compiled.get("kwargs"))
    assert engine.is_compiled == bool(compiled)
    dp = engine.mesh.size("dp")
    batches = rank_micro_batches(token_batches(STEPS, gas, dp) % vocab, engine.mesh.local_rank("dp"))
    losses, counts = [], []
    for s in range(STEPS):
        window = batches[s * gas:(s + 1) * gas]
        if engine.mesh.pp > 1:
            losses.append(float(engine.train_batch(iter(window))))
        else:
            total = 0.0
            for mb in window:
                loss = engine(**mb).loss
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / gas)
        counts.append(compile_counts())
    dist.barrier()
    params = engine.full_parameters()
    engine.destroy()
    return losses, params, counts


def _model(kind: str, layers: int) -> tuple[torch.nn.Module, int]:
    """tests.tiny's Llama or GPT-2 with ``layers`` blocks, or another family's tiny model
    (scripts/coverage_check.py, dropout off); and its vocabulary size."""
    if kind in ("llama", "gpt2"):
        model = make_model(kind, **{"num_hidden_layers" if kind == "llama" else "n_layer": layers})
        return model, model.config.vocab_size
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from coverage_check import tiny_model

    model = tiny_model(kind)
    return model, model.config.vocab_size


def compiled_against_eager(kind: str, config: dict, compiled: dict, layers: int = 3, by_method: bool = False,
                           hf_checkpointing: bool = False):
    import torch._dynamo

    torch._dynamo.reset()
    eager = _train(kind, config, None, layers, hf_checkpointing=hf_checkpointing)
    start = _counts_now()
    got = _train(kind, config, compiled, layers, by_method, hf_checkpointing)
    counts = [{k: c[k] - start[k] for k in c} for c in got[2]]
    return eager[:2], got[:2], counts


def _counts_now() -> dict[str, int]:
    from parallel3d.build.compiled_blocks import compile_counts

    return compile_counts()


def _check(results, frames: int = 1) -> None:
    for (want_losses, want_params), (losses, params), counts in results:
        assert losses == pytest.approx(want_losses, rel=RTOL)
        err, name = max_rel_param_error(params, want_params)
        assert err < RTOL, f"{name} differs from the eager run by {err:.2e}"
        assert counts[0]["graphs"] >= 1, f"nothing was compiled: {counts}"
        assert all(c["graph_breaks"] == 0 for c in counts), f"graph breaks inside the blocks: {counts}"
        assert counts[1:] == [counts[1]] * (STEPS - 1), f"recompiled after step 2: {counts}"
        assert counts[-1]["frames_compiled"] == frames, f"one compiled frame serves every block: {counts}"


def _config(stage: int, dp: int, gas: int = 1, **layout) -> dict:
    config = ds_config(stage, gas, dp, stage3_param_persistence_threshold=0, reduce_bucket_size=3000)
    config.update(layout)
    return config


INDUCTOR = {"backend": "inductor"}
AOT = {"backend": "aot_eager"}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stages_aot_eager(dist, stage):
    _check(dist.run(2, compiled_against_eager, "llama", _config(stage, 2), AOT))


def test_zero3_inductor(dist):
    """The gather/release hooks stay outside the compiled forward; the gathered params are graph inputs."""
    _check(dist.run(2, compiled_against_eager, "llama", _config(3, 2), INDUCTOR))


def test_zero3_activation_checkpointing(dist):
    """HF's gradient checkpointing re-runs each compiled block inside backward, where ZeRO-3's hooks
    keep its parameters gathered."""
    _check(dist.run(2, compiled_against_eager, "llama", _config(3, 2), AOT, hf_checkpointing=True))


def test_tensor_parallel_inductor(dist):
    """The tp collectives inside each block are traced (functional collectives on gloo)."""
    _check(dist.run(2, compiled_against_eager, "llama", _config(1, 1, tensor_parallel={"size": 2}), INDUCTOR))


def test_tensor_parallel_sequence_parallel_zero3_gpt2(dist):
    """GPT-2's Conv1D blocks, sequence parallelism's hooks on the first and last block, ZeRO-3 over nothing
    (dp 1 keeps the gathers local), through DeepSpeed's ``engine.compile()``."""
    layout = {"tensor_parallel": {"size": 2, "sequence_parallel": True}}
    _check(dist.run(2, compiled_against_eager, "gpt2", _config(3, 1, **layout), AOT, by_method=True))


def test_pipeline_inductor(dist):
    """Two stages with two blocks each under 1F1B; each rank compiles its own blocks."""
    _check(dist.run(2, compiled_against_eager, "llama", _config(1, 1, gas=2, pipeline={"stages": 2}), INDUCTOR,
                    layers=4))


def test_pipeline_activation_checkpointing_zero2(dist):
    """The pipeline's own recomputation (``pipeline.activation_checkpointing``) around compiled blocks."""
    layout = {"pipeline": {"stages": 2, "activation_checkpointing": True}}
    _check(dist.run(2, compiled_against_eager, "llama", _config(2, 1, gas=2, **layout), AOT, layers=4))


def test_pipeline_tensor_parallel_zero3(dist):
    """pp 2 x tp 2 on four ranks, ZeRO-3, GPipe."""
    layout = {"pipeline": {"stages": 2, "schedule": "gpipe"}, "tensor_parallel": {"size": 2}}
    _check(dist.run(4, compiled_against_eager, "llama", _config(3, 1, gas=2, **layout), AOT, layers=4))


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma2", "falcon", "mixtral"])
def test_families_zero3(dist, family):
    """More families' blocks (sliding windows, soft-capping, parallel attention, routed experts)
    compile whole at ZeRO-3 on one rank: the families whose tiny models coverage_check builds."""
    _check(dist.run(1, compiled_against_eager, family, _config(3, 1), AOT))


# --- refusals (no process group) ------------------------------------------------------------


def _error(config: dict) -> str:
    from parallel3d import initialize
    from parallel3d.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        initialize(model=make_model("llama"), config={**_config(0, 1), **config})
    return str(err.value)


@pytest.mark.parametrize("block,says", [
    ({"enabled": True, "deepcompile": True}, "compile.deepcompile: true is not supported"),
    ({"enabled": True, "passes": ["z3"]}, "compile.passes is a DeepSpeed key Zero3D does not implement"),
    ({"enabled": True, "kwargs": {"mode": "reduce-overhead"}}, "records CUDA graphs"),
    ({"enabled": True, "kwargs": {"options": {"triton.cudagraphs": True}}}, "triton.cudagraphs records CUDA graphs"),
    ({"enabled": True, "kwargs": {"backend": "eager"}}, "compile.kwargs.backend is set by compile.backend"),
    ({"enabled": True, "kwargs": {"fullgraf": True}}, "allowed: fullgraph, dynamic, mode, options"),
    ({"enabled": True, "backend": "no_such"}, 'compile.backend: "no_such" is not a torch.compile backend'),
    ({"enabled": True, "backend": "cudagraphs"}, 'compile.backend: "cudagraphs" records CUDA graphs'),
    ({"enabld": True}, "did you mean 'compile.enabled'"),
])
def test_refused_keys(block, says):
    assert says in _error({"compile": block})


def test_deepcompile_defaults_accepted():
    """DeepSpeed 0.19's DeepCompile keys at their defaults mean what leaving them out means."""
    from parallel3d.config.config import Zero3DConfig

    cfg = Zero3DConfig.from_dict({"compile": {"enabled": True, "deepcompile": False, "free_activation": False,
                                              "double_buffer": True, "passes": None, "kwargs": {"fullgraph": True}}})
    assert cfg.compile.enabled and cfg.compile.kwargs == {"fullgraph": True}


def _layout_error(model, tp: int, cp: int, ep: int = 1) -> str:
    """``initialize``'s check of the layout (run before any process group: a world of one cannot
    hold tp 2 or cp 2 in this process)."""
    from parallel3d.build.compiled_blocks import check_layout
    from parallel3d.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check_layout(model, tp, cp, ep)
    return str(err.value)


def test_tensor_parallel_dropout_refused():
    model = make_model("gpt2", resid_pdrop=0.1)
    message = _layout_error(model, 2, 1)
    assert "blocks use dropout (Dropout(p=0.1))" in message and "tensor_parallel.size 2" in message


def test_context_parallel_refused():
    assert "context_parallel.size 2 is not supported yet" in _layout_error(make_model("llama"), 1, 2)


def test_expert_parallel_refused():
    assert "expert_parallel.autoep_size 2 is not supported yet" in _layout_error(make_model("llama"), 1, 1, 2)


def test_random_draws_names_attention_dropout():
    from parallel3d.build.compiled_blocks import random_draws
    from models import fetch_unit_modules

    model = make_model("llama", attention_dropout=0.25)
    assert random_draws(fetch_unit_modules(model)) == ["LlamaAttention.attention_dropout=0.25"]
    assert random_draws(fetch_unit_modules(make_model("llama"))) == []
