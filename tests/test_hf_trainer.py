"""``parallel3d.hf.Trainer`` against the plain ``transformers.Trainer`` on one process.

The data has uneven label counts per row (a prefix of each row is -100), so the Trainer's
token-mean loss (``num_items_in_batch``) differs from a mean of micro-batch means and a
wrong dp or accumulation factor shows in the losses. Every layout trains the same global batch
(4 rows x 2 accumulation steps) in the same order (sequential sampling) in fp32; the losses the
Trainer logs at every step must agree with the oracle's to 1e-5.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.tiny import SEQ, VOCAB, make_model

STEPS = 4
GLOBAL_MICRO = 4  # rows per micro-batch over all dp ranks
GAS = 2
RTOL = 1e-5
EVAL_ROWS = 8
SHORT_EVAL_ROWS = 7  # at one replica (micro-batch 4): a last eval batch of 3


def rows(n: int = STEPS * GLOBAL_MICRO * GAS, seed: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        # at least the first label is -100: the count is then the same shifted or not (the suite's float64
        # loss wrapper hides from transformers that the loss shifts labels, so it counts them unshifted)
        labels[: int(torch.randint(1, SEQ - 2, (1,), generator=g))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def training_args(out: str, micro: int, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=out, per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
                  gradient_accumulation_steps=GAS, learning_rate=1e-2, max_steps=STEPS, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, optim="adamw_torch",
                  train_sampling_strategy="sequential", seed=0, disable_tqdm=True, lr_scheduler_type="linear",
                  warmup_steps=1, weight_decay=0.01, max_grad_norm=0.5)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def logged(trainer, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@functools.cache
def oracle(tmp: str, n_rows: int | None = None, eval_rows: int = EVAL_ROWS,
           **overrides) -> tuple[list[float], list[float], float]:
    """The plain Trainer on this one process: losses, grad norms, eval loss."""
    from transformers import Trainer

    trainer = Trainer(model=make_model("llama"), args=training_args(tmp, GLOBAL_MICRO, **overrides),
                      train_dataset=rows(n_rows) if n_rows else rows(), eval_dataset=rows(eval_rows, seed=9))
    trainer.train()
    return logged(trainer), logged(trainer, "grad_norm"), logged(trainer, "learning_rate"), \
        trainer.evaluate()["eval_loss"]


def zero3d_run(out: str, config: dict, n_rows: int | None = None, eval_rows: int = EVAL_ROWS,
               **overrides) -> tuple[list[float], list[float], float]:
    import torch.distributed as dist

    from parallel3d.hf import Trainer

    dp = dist.get_world_size() // config.get("tensor_parallel", {}).get("size", 1) \
        // config.get("pipeline", {}).get("stages", 1)
    trainer = Trainer(model=make_model("llama"), args=training_args(out, GLOBAL_MICRO // dp, **overrides),
                      train_dataset=rows(n_rows) if n_rows else rows(), eval_dataset=rows(eval_rows, seed=9),
                      zero3d_config=config)
    trainer.train()
    return logged(trainer), logged(trainer, "grad_norm"), logged(trainer, "learning_rate"), \
        trainer.evaluate()["eval_loss"]


LAYOUTS = {  # config, TrainingArguments overrides, eval rows
    "zero3_dp2": ({"zero_optimization": {"stage": 3}}, {}, EVAL_ROWS),
    "zero3_dp2_checkpointed": ({"zero_optimization": {"stage": 3}}, {"activation_checkpointing": True}, EVAL_ROWS),
    # the engine's own token mean: the Trainer's dp factor must not apply on top of the engine's
    "zero3_dp2_tokens": ({"zero_optimization": {"stage": 3}, "loss_normalization": "tokens"}, {}, EVAL_ROWS),
    # one replica over two ranks, a short last eval batch: the eval results are gathered over dp only
    # (over every rank each batch would come back twice, the trimmed last one once)
    "tp2": ({"zero_optimization": {"stage": 3}, "tensor_parallel": {"size": 2}}, {}, SHORT_EVAL_ROWS),
    "pp2": ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}, {}, SHORT_EVAL_ROWS),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_plain_trainer(dist, tmp_path_factory, layout):
    config, overrides, eval_rows = LAYOUTS[layout]
    want_loss, want_norm, want_lr, want_eval = oracle(str(tmp_path_factory.mktemp("oracle")), eval_rows=eval_rows)
    out = str(tmp_path_factory.mktemp(layout))
    results = dist.run(2, zero3d_run, out, config, eval_rows=eval_rows, **overrides)
    for loss, norm, lr, eval_loss in results:
        assert len(loss) == STEPS and lr == want_lr  # the schedule's rate of each step, as logged
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want_norm), rtol=RTOL, atol=0)
        assert eval_loss == pytest.approx(want_eval, rel=RTOL)


def test_short_last_window_of_an_epoch(dist, tmp_path_factory):
    """One epoch of 7 micro-batches per rank at 2 accumulation steps: the last window has one; the
    Trainer's loop tells the engine where each window ends."""
    epoch = dict(max_steps=-1, num_train_epochs=1)
    want_loss, want_norm, want_lr, _ = oracle(str(tmp_path_factory.mktemp("oracle_short")), 28, **epoch)
    results = dist.run(2, zero3d_run, str(tmp_path_factory.mktemp("short")), {"zero_optimization": {"stage": 3}}, 28,
                       **epoch)
    assert len(want_loss) == 4
    for loss, norm, lr, _ in results:
        assert lr == want_lr
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want_loss), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(want_norm), rtol=RTOL, atol=0)


def client_optimizer_run(out: str, micro: int, config: dict | None) -> tuple[list[float], list[float]]:
    """``optimizers=(AdamW, LambdaLR)`` built by the script over the unsharded model; plain Trainer
    without ``config``."""
    import transformers

    from parallel3d.hf import Trainer

    model = make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    kwargs = dict(model=model, args=training_args(out, micro), optimizers=(opt, schedule), train_dataset=rows())
    trainer = transformers.Trainer(**kwargs) if config is None else Trainer(**kwargs, zero3d_config=config)
    trainer.train()
    return logged(trainer), logged(trainer, "learning_rate")


def test_optimizer_and_schedule_of_the_script(dist, tmp_path):
    want = client_optimizer_run(str(tmp_path / "oracle"), GLOBAL_MICRO, None)
    for loss, lr in dist.run(2, client_optimizer_run, str(tmp_path / "z2"), GLOBAL_MICRO // 2,
                             {"zero_optimization": {"stage": 2}}):
        assert lr == want[1]
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(want[0]), rtol=RTOL, atol=0)


PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def engine_logits(trainer) -> torch.Tensor:
    with torch.no_grad():
        return trainer.model_wrapped(input_ids=PROBE).logits.detach().clone()


def save_and_resume(out: str) -> dict:
    """Train 4 steps saving at 2, save_model, generate; resume a fresh Trainer from checkpoint-2; start
    a third from the saved directory (on the meta device)."""
    from parallel3d.hf import Trainer

    config = {"zero_optimization": {"stage": 3}}
    micro = GLOBAL_MICRO // 2
    first = Trainer(model=make_model("llama"), args=training_args(out, micro, save_strategy="steps", save_steps=2),
                    train_dataset=rows(), zero3d_config=config)
    first.train()
    first.save_model(os.path.join(out, "final"))
    trained = engine_logits(first)
    generated = first.generate(input_ids=PROBE[:, :4], max_new_tokens=6, do_sample=False)
    resumed = Trainer(model=make_model("llama", seed=1), args=training_args(out, micro), train_dataset=rows(),
                      zero3d_config=config)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    from_dir = Trainer(model=os.path.join(out, "final"), args=training_args(out, micro), zero3d_config=config)
    return {"losses": logged(first), "resumed": logged(resumed), "trained": trained, "generated": generated,
            "after_resume": engine_logits(resumed), "from_dir": engine_logits(from_dir)}


def test_save_resume_generate_and_from_pretrained(dist, tmp_path):
    from transformers import LlamaForCausalLM

    results = dist.run(2, save_and_resume, str(tmp_path))
    got = results[0]
    assert {"trainer_state.json", "zero3d"} <= set(os.listdir(tmp_path / "checkpoint-2"))
    assert got["resumed"] == got["losses"]  # the history of steps 1-2 from the checkpoint, then 3-4 trained again
    torch.testing.assert_close(got["after_resume"], got["trained"], rtol=0, atol=0)
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        reloaded = saved(input_ids=PROBE).logits
    torch.testing.assert_close(reloaded, got["trained"], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["generated"], saved.generate(input_ids=PROBE[:, :4], max_new_tokens=6, do_sample=False))
    torch.testing.assert_close(got["from_dir"], got["trained"], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(r["trained"], got["trained"]) for r in results)


def best_model_run(out: str) -> tuple[list[float], str, list[str], float]:
    from parallel3d.hf import Trainer

    trainer = Trainer(model=make_model("llama"), train_dataset=rows(), eval_dataset=rows(8, seed=9),
                      args=training_args(out, GLOBAL_MICRO // 2, eval_strategy="steps", eval_steps=1,
                                         save_strategy="steps", save_steps=1, save_total_limit=2,
                                         load_best_model_at_end=True),
                      zero3d_config={"zero_optimization": {"stage": 3}})
    trainer.train()
    return (logged(trainer, "eval_loss"), trainer.state.best_model_checkpoint, sorted(os.listdir(out)),
            trainer.evaluate()["eval_loss"])


def test_load_best_model_at_end(dist, tmp_path):
    """Evaluated and saved every step, two checkpoints kept: the best step's weights come back."""
    for evals, best, kept, final in dist.run(2, best_model_run, str(tmp_path)):
        step = min(range(len(evals)), key=evals.__getitem__) + 1
        assert step < len(evals)  # else the last weights would pass for the best
        assert best == str(tmp_path / f"checkpoint-{step}") and f"checkpoint-{step}" in kept and len(kept) <= 3
        assert final == pytest.approx(evals[step - 1], rel=1e-6)


def resume_on_another_layout(out: str) -> tuple[list[float], list[float]]:
    from parallel3d.hf import Trainer

    first = Trainer(model=make_model("llama"), train_dataset=rows(), zero3d_config={"zero_optimization": {"stage": 3}},
                    args=training_args(out, GLOBAL_MICRO // 2, save_strategy="steps", save_steps=2))
    first.train()
    tp = Trainer(model=make_model("llama"), args=training_args(out, GLOBAL_MICRO), train_dataset=rows(),
                 zero3d_config={"zero_optimization": {"stage": 1}, "tensor_parallel": {"size": 2}})
    tp.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    return logged(first), logged(tp)


def test_resume_on_another_layout(dist, tmp_path):
    """A checkpoint of ZeRO-3 over dp 2 resumes at ZeRO-1 with tp 2 (dp 1): the same losses."""
    for trained, resumed in dist.run(2, resume_on_another_layout, str(tmp_path)):
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(trained), rtol=RTOL, atol=0)
