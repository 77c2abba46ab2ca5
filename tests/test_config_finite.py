"""Float settings that cannot work are refused by config validation (issue 35): an lr of inf (or
one that overflows float, 1e400), nan in any optimizer or scheduler option, a collective timeout
below a millisecond."""

from __future__ import annotations

import pytest

from parallel3d.config.config import load_config
from parallel3d.errors import ConfigError
from parallel3d.job.config import load_job_config
from tests.test_job_config import job

INF, NAN = float("inf"), float("nan")
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}


@pytest.mark.parametrize("change,message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": INF}}},
     "optimizer.params.lr: Infinity must be a finite number (not inf or nan)"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 1e400}}},  # overflows to inf when parsed
     "optimizer.params.lr: Infinity must be a finite number (not inf or nan)"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": NAN}}},
     "optimizer.params.lr: NaN must be a finite number (not inf or nan)"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, INF]}}},
     "optimizer.params.betas: [0.9, Infinity] must be finite numbers (not inf or nan)"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": -INF}}},
     "optimizer.params.weight_decay: -Infinity must be a finite number (not inf or nan)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": INF}}},
     "scheduler.params.warmup_max_lr: Infinity must be a finite number >= 0 or a list of them, one per param group"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": NAN}}},
     "scheduler.params.cos_min_ratio: NaN must be a finite number (not inf or nan)"),
    ({"gradient_clipping": INF}, "gradient_clipping: Infinity must be a finite number (not inf or nan)"),
    ({"comm": {"timeout_s": 1e-9}}, "comm.timeout_s: 1e-09 must be >= 0.001"),
])
def test_a_float_that_cannot_work_is_refused(change, message):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, **change}
    with pytest.raises(ConfigError) as info:
        load_config(config, 1)
    assert str(info.value) == message


def test_finite_values_still_load():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "comm": {"timeout_s": 0.001},
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}}, 1)
    assert cfg.comm.timeout_s == 0.001 and cfg.optimizer.params["betas"] == [0.9, 0.95]


def test_the_job_config_refuses_them_too():
    with pytest.raises(ConfigError) as info:
        load_job_config(job(), ["engine.optimizer.params.lr=.inf"])
    assert "optimizer.params.lr: Infinity must be a finite number (not inf or nan)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_job_config(job(train={"max_steps": None, "epochs": INF}))
    assert str(info.value) == "train.epochs: Infinity must be a finite number (not inf or nan)"
