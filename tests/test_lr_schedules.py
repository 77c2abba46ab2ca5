"""parallel3d.lr.schedules against DeepSpeed's own classes as the oracle."""

import io
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
from deepspeed.runtime import lr_schedules as ds

from parallel3d.errors import ConfigError
from parallel3d.lr.cycles import LRRangeTest, OneCycle
from parallel3d.lr.build import build_lr_scheduler
from parallel3d.lr.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS = 50

CASES = [
    # WarmupLR
    (WarmupLR, ds.WarmupLR, dict(warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=10)),
    (WarmupLR, ds.WarmupLR, dict(warmup_min_lr=1e-5, warmup_max_lr=3e-3, warmup_num_steps=1)),
    (WarmupLR, ds.WarmupLR, dict(warmup_min_lr=[1e-4, 2e-5], warmup_max_lr=(0.01, 0.002),
                                 warmup_num_steps=7)),
    (WarmupLR, ds.WarmupLR, dict(warmup_num_steps=20)),  # max_lr=None: the groups' lrs
    (WarmupLR, ds.WarmupLR, dict(warmup_min_lr=0.5, warmup_max_lr=0.1, warmup_num_steps=60)),
    (WarmupLR, ds.WarmupLR, dict()),
    # WarmupDecayLR (several run past total_num_steps)
    (WarmupDecayLR, ds.WarmupDecayLR, dict(total_num_steps=30, warmup_min_lr=1e-6,
                                           warmup_max_lr=1e-3, warmup_num_steps=10)),
    (WarmupDecayLR, ds.WarmupDecayLR, dict(total_num_steps=1, warmup_num_steps=1)),
    (WarmupDecayLR, ds.WarmupDecayLR, dict(total_num_steps=2, warmup_num_steps=1)),
    (WarmupDecayLR, ds.WarmupDecayLR, dict(total_num_steps=10, warmup_num_steps=10)),
    (WarmupDecayLR, ds.WarmupDecayLR, dict(total_num_steps=49, warmup_num_steps=3,
                                           warmup_min_lr=[0.0, 1e-4], warmup_max_lr=[1e-2, 1e-3])),
    (WarmupDecayLR, ds.WarmupDecayLR, dict(total_num_steps=5000)),
    # WarmupCosineLR
    (WarmupCosineLR, ds.WarmupCosineLR, dict(total_num_steps=30, warmup_num_steps=10)),
    (WarmupCosineLR, ds.WarmupCosineLR, dict(total_num_steps=40, warmup_min_ratio=0.1,
                                             warmup_num_steps=5, cos_min_ratio=0.05)),
    (WarmupCosineLR, ds.WarmupCosineLR, dict(total_num_steps=1, warmup_num_steps=1)),
    (WarmupCosineLR, ds.WarmupCosineLR, dict(total_num_steps=5, warmup_num_steps=1,
                                             cos_min_ratio=0.0)),
    (WarmupCosineLR, ds.WarmupCosineLR, dict(total_num_steps=10, warmup_num_steps=10)),
    (WarmupCosineLR, ds.WarmupCosineLR, dict(total_num_steps=5000)),
]


def _ids():
    return [f"{ours.__name__}-{i}" for i, (ours, _, _) in enumerate(CASES)]


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}], lr=0.1)


def _lrs(opt) -> list:
    return [g["lr"] for g in opt.param_groups]


def _same(a: list, b: list) -> None:
    assert a == pytest.approx(b, rel=1e-12, abs=0.0)


def _run(cls, kwargs, steps=STEPS, opt=None):
    """Lrs in the groups after construction and after each step(), plus get_last_lr()."""
    opt = _optimizer() if opt is None else opt
    sched = cls(opt, **kwargs)
    trace = [_lrs(opt), list(sched.get_last_lr())]
    for _ in range(steps):
        sched.step()
        trace += [_lrs(opt), list(sched.get_last_lr())]
    return sched, trace


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("ours,oracle,kwargs", CASES, ids=_ids())
def test_matches_deepspeed(ours, oracle, kwargs, warmup_type):
    kwargs = dict(kwargs, warmup_type=warmup_type)
    _, expected = _run(oracle, kwargs)
    _, got = _run(ours, kwargs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        _same(g, e)


CYCLE_CASES = [
    (OneCycle, ds.OneCycle, dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=10)),
    (OneCycle, ds.OneCycle, dict(cycle_min_lr=[1e-4, 1e-5], cycle_max_lr=(1e-2, 1e-3), cycle_first_step_size=7,
                                 cycle_second_step_size=13, decay_lr_rate=0.1, decay_step_size=3,
                                 cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.01)),
    (OneCycle, ds.OneCycle, dict(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=12,
                                 cycle_second_step_size=5, cycle_first_stair_count=4, cycle_second_stair_count=2)),
    (OneCycle, ds.OneCycle, dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5,
                                 cycle_second_step_size=0, cycle_momentum=False)),
    (LRRangeTest, ds.LRRangeTest, dict()),
    (LRRangeTest, ds.LRRangeTest, dict(lr_range_test_min_lr=[1e-4, 1e-3], lr_range_test_step_size=4,
                                       lr_range_test_step_rate=0.5)),
    (LRRangeTest, ds.LRRangeTest, dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=3,
                                       lr_range_test_step_rate=2.0, lr_range_test_staircase=True)),
]


def _adam() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}], lr=0.1, betas=(0.8, 0.9))


@pytest.mark.parametrize("make_optimizer", [_optimizer, _adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("ours,oracle,kwargs", CYCLE_CASES, ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CYCLE_CASES)])
def test_cycles_match_deepspeed(ours, oracle, kwargs, make_optimizer):
    """lr and (Adam's) betas after every step, 50 steps: through the cycle, its stairs and the decay."""
    opt, ds_opt = make_optimizer(), make_optimizer()
    mine, theirs = ours(opt, **kwargs), oracle(ds_opt, **kwargs)
    for _ in range(STEPS):
        assert [g.get("betas") for g in opt.param_groups] == [g.get("betas") for g in ds_opt.param_groups]
        _same(_lrs(opt), _lrs(ds_opt))
        mine.step()
        theirs.step()
        _same(list(mine.get_last_lr()), list(theirs.get_last_lr()))
    assert mine.state_dict() == theirs.state_dict() == {"last_batch_iteration": STEPS - 1}


def test_one_cycle_from_a_config_section():
    opt = _adam()
    sched = build_lr_scheduler(opt, "OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
                                                 "cycle_first_step_size": 4})
    for _ in range(4):
        sched.step()
    assert _lrs(opt) == pytest.approx([0.01, 0.01])  # the top of the cycle after its first half
    assert [g["betas"] for g in opt.param_groups] == [(pytest.approx(0.8), 0.99)] * 2


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("ours,oracle,kwargs", CASES, ids=_ids())
def test_state_dict_round_trip(ours, oracle, kwargs, warmup_type):
    kwargs = dict(kwargs, warmup_type=warmup_type)
    _, full = _run(ours, kwargs, steps=40)

    first, _ = _run(ours, kwargs, steps=17)
    sd = first.state_dict()
    ds_first, _ = _run(oracle, kwargs, steps=17)
    assert sd == ds_first.state_dict() == {"last_batch_iteration": 16}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    opt = _optimizer()
    resumed = ours(opt, **kwargs)
    resumed.load_state_dict(loaded)
    oracle_opt = _optimizer()
    oracle_resumed = oracle(oracle_opt, **kwargs)
    oracle_resumed.load_state_dict(loaded)  # our checkpoint loads into DeepSpeed too
    for i in range(17, 40):
        resumed.step()
        oracle_resumed.step()
        _same(_lrs(opt), full[2 * (i + 1)])
        _same(_lrs(oracle_opt), full[2 * (i + 1)])


def test_state_dict_format_matches_deepspeed():
    opt, ds_opt = _optimizer(), _optimizer()
    ours = WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=5)
    theirs = ds.WarmupDecayLR(ds_opt, total_num_steps=20, warmup_num_steps=5)
    for _ in range(7):
        ours.step()
        theirs.step()
    assert ours.state_dict() == theirs.state_dict() == {"last_batch_iteration": 6}
    assert type(ours.state_dict()["last_batch_iteration"]) is int


@pytest.mark.parametrize("ours,oracle,kwargs", [CASES[0], CASES[6], CASES[13]],
                         ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_resume_constructor_and_explicit_step(ours, oracle, kwargs):
    """last_batch_iteration >= 0 leaves the lrs alone at construction; step(n) jumps to n."""
    opt, ds_opt = _optimizer(), _optimizer()
    s = ours(opt, last_batch_iteration=5, **kwargs)
    d = oracle(ds_opt, last_batch_iteration=5, **kwargs)
    assert _lrs(opt) == _lrs(ds_opt) == [0.1, 0.02]
    with pytest.raises(RuntimeError, match="step"):
        s.get_last_lr()
    for it in [None, None, 25, None, 3, 60]:
        s.step(it)
        d.step(it)
        _same(_lrs(opt), _lrs(ds_opt))
        _same(s.get_lr(), d.get_lr())


def test_param_groups_wrapper_and_tensor_lr():
    class Wrapper:  # not a torch optimizer, only exposes param_groups
        def __init__(self):
            self.param_groups = [{"lr": 0.1}, {"lr": torch.tensor(0.02, dtype=torch.float64)}]

    w = Wrapper()
    tensor_lr = w.param_groups[1]["lr"]
    s = WarmupLR(w, warmup_num_steps=4, warmup_type="linear")  # max_lr from the groups
    assert w.param_groups[0]["lr"] == 0.0 and float(tensor_lr) == 0.0
    for _ in range(3):
        s.step()
    assert w.param_groups[1]["lr"] is tensor_lr  # filled in place
    assert w.param_groups[0]["lr"] == pytest.approx(0.1 * 2 / 4)
    assert float(tensor_lr) == pytest.approx(0.02 * 2 / 4)
    for _ in range(5):
        s.step()
    assert float(tensor_lr) == pytest.approx(0.02)  # max_lr did not alias the filled tensor


def test_build_lr_scheduler():
    for name, cls, params in [("WarmupLR", WarmupLR, {"warmup_max_lr": 0.01}),
                              ("WarmupDecayLR", WarmupDecayLR, {"total_num_steps": 100}),
                              ("WarmupCosineLR", WarmupCosineLR, {"total_num_steps": 100})]:
        opt, ds_opt = _optimizer(), _optimizer()
        sched = build_lr_scheduler(opt, name, dict(params, warmup_num_steps=10))
        oracle = getattr(ds, name)(ds_opt, **params, warmup_num_steps=10)
        assert type(sched) is cls
        for _ in range(20):
            sched.step()
            oracle.step()
        _same(_lrs(opt), _lrs(ds_opt))


@pytest.mark.parametrize("make,message", [
    (lambda o: WarmupLR(o, warmup_type="cosine"),
     "warmup_type='cosine' is invalid: it must be one of 'log', 'linear'"),
    (lambda o: WarmupCosineLR(o, 5000, warmup_type="exp"), "warmup_type='exp' is invalid"),
    (lambda o: WarmupDecayLR(o, total_num_steps=5, warmup_num_steps=10),
     "total_num_steps=5 is invalid: it must be >= warmup_num_steps (10)"),
    (lambda o: WarmupCosineLR(o, total_num_steps=999),
     "total_num_steps=999 is invalid: it must be >= warmup_num_steps (1000)"),
    (lambda o: WarmupDecayLR(o, total_num_steps=0, warmup_num_steps=1),
     "total_num_steps=0 is invalid: it must be a positive integer"),
    (lambda o: WarmupLR(o, warmup_num_steps=0),
     "warmup_num_steps=0 is invalid: it must be a positive integer"),
    (lambda o: WarmupCosineLR(o, 10, warmup_num_steps=2.5),
     "warmup_num_steps=2.5 is invalid: it must be a positive integer"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.0, 0.0]),
     "warmup_min_lr=[0.0, 0.0, 0.0] is invalid: a list must have one value per param group (2)"),
    (lambda o: build_lr_scheduler(o, "Cyclic", {}),
     "scheduler.type='Cyclic' is invalid: it must be one of WarmupLR, WarmupDecayLR, "
     "WarmupCosineLR, OneCycle, LRRangeTest"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0),
     "cycle_first_step_size=0 is invalid: it must be positive"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0),
     "lr_range_test_step_size=0 is invalid: it must be a positive integer"),
    (lambda o: build_lr_scheduler(o, "WarmupLR", {"warmup_steps": 10}),
     "scheduler.params.warmup_steps=10 is invalid: WarmupLR accepts only warmup_min_lr"),
    (lambda o: build_lr_scheduler(o, "WarmupDecayLR", {"warmup_num_steps": 10}),
     "scheduler.params.total_num_steps is missing: WarmupDecayLR requires it"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ConfigError) as info:
        make(_optimizer())
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
