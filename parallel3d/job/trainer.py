"""The training loop of ``zero3d train``, run on every rank after `prepare`.

Order per rank: seed, build the model, ``parallel3d.initialize``, data sampler for this dp
rank, resume (engine state + data position), validate at step 0, then per step:
``engine.train_batch`` -> metrics -> validation every eval_interval -> checkpoint every
save_interval (keep-last-k pruned by rank 0 once the new one is complete).
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

import parallel3d
from parallel3d.errors import ConfigError
from parallel3d.job.checkpoints import Pruner, checkpoint_root
from parallel3d.job.metrics import Metrics, summary_text
from parallel3d.job.lora import apply_lora
from parallel3d.job.model import build_model, weights_note
from parallel3d.job.prepare import Prepared, describe
from parallel3d.job.sampler import BlockSampler, TrainLoader, eval_batches
from parallel3d.job.schedule import STATE_KEY, schedule_state
from parallel3d.job.stop import JobStopped, StopSignals
from parallel3d.engine.token_mean import global_label_tokens

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def evaluate(engine, blocks, micro: int, max_batches: int | None) -> float:
    """Mean validation loss over every dp rank's share: over its micro-batches (each holds the same
    tokens), or under ``loss_normalization: "tokens"`` over its label tokens.

    Every dp rank gets the same number of batches; they go through ``engine.eval_batch`` a
    window of ``gradient_accumulation_steps`` at a time (the last window may be shorter),
    which returns each window's dp mean on every layout.
    """
    mesh = engine.mesh
    batches = list(eval_batches(blocks, micro, mesh.dp, mesh.local_rank("dp"), max_batches))
    window = engine.gradient_accumulation_steps
    total, count = 0.0, 0
    engine.eval()
    for start in range(0, len(batches), window):
        part = batches[start : start + window]
        # a window's weight: its micro-batches, or under the token mean its label tokens (all dp ranks')
        weight = (int(global_label_tokens(part, mesh.dp_group, engine.device, at_least_one=False)) if engine.token_mean else len(part))
        total += engine.eval_batch(iter(part), num_micro_batches=len(part)) * weight
        count += weight
    engine.train()
    if count == 0:  # only under the token mean: prepare() refused a validation split of fewer than dp x micro blocks
        raise ConfigError("validation: no block of the validation split has a label token (every label is -100), so "
                          "its loss is undefined; give validation data with trained tokens or set "
                          "data.validation_fraction to 0 (no validation)")
    return total / count


def _agreed_stop(engine, stop: StopSignals) -> int:
    """The stop signal any rank received (a collective; its failure is explained like the engine's)."""
    if engine.watchdog is None:
        return stop.agreed(engine.device)
    with engine.watchdog.explaining():
        return stop.agreed(engine.device)


def _write_run_files(prep: Prepared, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    prep.tokenizer.save_pretrained(str(out / "tokenizer"))
    (out / "job.yaml").write_text(yaml.safe_dump(prep.job.model_dump(mode="json"), sort_keys=False))


def train(prep: Prepared) -> dict:
    """Train the prepared job on this rank; returns the run summary (rank 0's is complete).

    A stop signal ends it after the current step with `JobStopped` (parallel3d/job/stop.py).
    """
    with StopSignals() as stop:
        return _train(prep, stop)


def _train(prep: Prepared, stop: StopSignals) -> dict:
    job, rank = prep.job, _rank()
    cfg = job.train
    out = Path(cfg.output_dir)
    if rank == 0:
        logger.info(describe(prep))
    seed_everything(cfg.seed)
    model = apply_lora(job, build_model(job, prep.hf_config))
    engine, _, _, _ = parallel3d.initialize(model=model, config=prep.engine_config, pretrained=job.model.path)
    if rank == 0 and job.model.path is not None:
        logger.info(weights_note(job.model.path))
    mesh = engine.mesh
    micro, gas = engine.config.train_micro_batch_size_per_gpu, engine.config.gradient_accumulation_steps
    sampler = BlockSampler(len(prep.blocks["train"]), micro, mesh.dp, mesh.local_rank("dp"), gas, cfg.seed)
    loader = TrainLoader(prep.blocks["train"], sampler)
    val = prep.blocks["validation"]
    root = checkpoint_root(job)
    tokens = 0
    if prep.resume_from is not None:
        path, client = engine.load_checkpoint(str(root), tag=prep.resume_from.name)
        sampler.load_state_dict(client["data"])
        tokens = int(client.get("tokens", 0))
        if rank == 0:
            logger.info("resumed from %s at step %d (epoch %d, micro-batch %d)", path, engine.global_steps,
                        sampler.epoch, sampler.position)
            if prep.info.get("schedule_note"):
                logger.info(prep.info["schedule_note"])
    if rank == 0:  # only now: a resume that fails to load leaves the run's job.yaml and tokenizer as they were
        _write_run_files(prep, out)
    start, total = engine.global_steps, prep.total_steps
    if cfg.progress and rank == 0:
        logging.getLogger("parallel3d.engine.engine").setLevel(logging.WARNING)  # the bar shows the loss
    metrics = Metrics(out, rank == 0, total, start, cfg.progress)
    t_run = time.perf_counter()
    last_saved = start if prep.resume_from is not None else None
    pruner = Pruner(root, cfg.keep_last, rank == 0)
    try:
        if start == 0 and val is not None:
            metrics.log({"step": 0, "val_loss": evaluate(engine, val, micro, cfg.eval_batches)})
        for step in range(start + 1, total + 1):
            lr = engine.get_lr()[0]  # the lr this step uses
            t0 = time.perf_counter()
            loss = engine.train_batch(loader)
            dt = time.perf_counter() - t0
            pruner.poll(engine)  # a background save published during this step
            tokens += prep.tokens_per_step
            record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": prep.tokens_per_step / dt,
                      "s_per_step": dt, "tokens": tokens, "epoch": round(sampler.epochs_done, 4),
                      "memory_mib": sum(engine.memory_report().values()) / 2**20}
            if val is not None and ((cfg.eval_interval and step % cfg.eval_interval == 0) or step == total):
                record["val_loss"] = evaluate(engine, val, micro, cfg.eval_batches)
            metrics.log(record)
            signum = _agreed_stop(engine, stop)
            if (cfg.save_interval and step % cfg.save_interval == 0) or (step == total and cfg.save_final) or (
                    signum and cfg.save_on_signal):
                engine.save_checkpoint(str(root), client_state={"data": sampler.state_dict(), "tokens": tokens,
                                                                 STATE_KEY: schedule_state(prep.engine_config)})
                last_saved = step
                pruner.saved(engine)
            if signum and step < total:
                engine.wait_for_checkpoint()
                pruner.poll(engine)
                raise JobStopped(signum, step, str(root / f"global_step{last_saved}") if last_saved else None)
        engine.wait_for_checkpoint()  # a background save (checkpoint.async_save) is published before we end
        pruner.poll(engine)
    finally:
        metrics.close()
    if start >= total and rank == 0:
        logger.info("nothing to train: the checkpoint is at step %d and train.max_steps/epochs ask for %d", start, total)
    extra = {"output_dir": str(out), "metrics": str(metrics.path), "tokenizer": str(out / "tokenizer"),
             "checkpoint": str(root / f"global_step{last_saved}") if last_saved else None,
             "total_steps": total, "resumed_from_step": start if prep.resume_from is not None else None,
             "world_size": prep.world_size, "dp": mesh.dp, "tokens_per_step": prep.tokens_per_step}
    summary = metrics.summary(time.perf_counter() - t_run, prep.tokens_per_step, extra)
    summary["records"] = [r for r in metrics.records if start == 0 or r["step"] > start]  # this run's part
    if rank == 0:
        (out / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=2))
        logger.info("summary:\n  %s", summary_text(summary))
    return summary
