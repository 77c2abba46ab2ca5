"""The report of scripts/ds_unit_tests.py: pass counts per file and every failure with its class.

A failure's class comes from the first rule of ``RULES`` whose pattern matches the test id or
the failure's message:

- ``DeepSpeed internal``: the test inspects an object of DeepSpeed's implementation (a class,
  attribute or buffer of its engine or optimizers) that Zero3D does not reproduce; the training
  behaviour under test is not what fails;
- ``not supported``: a DeepSpeed feature Zero3D does not claim, refused with a message that
  names it (or, for a test that expects DeepSpeed's own error, an input Zero3D has no reason to
  refuse);
- ``wrong behaviour``: Zero3D's result differs from DeepSpeed's; each such rule names the
  issue that tracks it.

A failure no rule matches is ``unclassified``: the report lists it first, to be looked at.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import TextIO

INTERNAL, UNSUPPORTED, WRONG, UNCLASSIFIED = "DeepSpeed internal", "not supported", "wrong behaviour", "unclassified"
BEGIN, END = "<!-- ds-unit-report:begin -->", "<!-- ds-unit-report:end -->"


@dataclass(frozen=True)
class Rule:
    cls: str
    pattern: str
    """A regular expression searched in "<test id>\\n<failure message>"."""
    why: str


_RETURNED = ("the test checks the class or identity of the optimizer initialize returned; Zero3D returns its "
             "ZeroOptimizer (the client's or config's torch optimizer is its .inner, with DeepSpeed's adam_w_mode)")

RULES: tuple[Rule, ...] = (
    # the optimizer object DeepSpeed builds or returns
    Rule(INTERNAL, r"assert isinstance\((ds_optimizer|optimizer|opt)\b.*(FusedAdam|DeepSpeedCPUAdam|FusedLamb|"
                   r"DeepSpeedZeroOptimizer|FP16_Optimizer|ZeROOptimizer|BF16_Optimizer)", _RETURNED),
    Rule(INTERNAL, r"test_adamw\.py::TestAdamConfigs::test\[\w+-\w+-False-.*\n.*AssertionError", _RETURNED +
         "; DeepSpeed's FusedAdam or DeepSpeedCPUAdam expected here (the torch_adam cases of this test pass)"),
    Rule(INTERNAL, r"assert isinstance\(ds_optimizer, AdamW\)|assert ds_optimizer == client_optimizer", _RETURNED),
    Rule(INTERNAL, r"isinstance\(<zero\.optimizer\.ZeroOptimizer object at \w+>, (DeepSpeed\w+|FusedAdam|FP16_Optimizer|"
                   r"BF16_Optimizer)\)", _RETURNED),
    Rule(INTERNAL, r"has no attribute '(loss_scale_config|bit16_groups_flat|fp16_groups|ds_active_sub_modules|"
                   r"ds_param_alias|_config|tput_timer|accumulated_grads_in_cpu|averaged_gradients|"
                   r"_change_recovery_script_permissions)'",
         "the test reads an attribute of DeepSpeed's engine, optimizer or partitioned parameters"),
    Rule(INTERNAL, r"\.ds_(status|tensor|numel|shape|active_sub_modules|param_alias|external)\b|ZeroParamStatus|"
                   r"tput_timer",
         "the test reads the state of DeepSpeed's partitioned parameters (ds_status, ds_tensor, ...) or its "
         "throughput timer; Zero3D's stage-3 parameters carry no such state"),
    Rule(INTERNAL, r"(pre|post)_bwd_fn|ds_grads_remaining|_ds_hooks|ds_external_parameters|ZeROOrderedDict",
         "the test inspects the hooks or bookkeeping DeepSpeed's stage 3 attaches to the modules"),
    Rule(INTERNAL, r"F\.linear is zero3_linear_wrap|monkeypatch\.setattr\(engine, \"pipeline_parallelism",
         "the test checks or patches DeepSpeed's own functions or engine attributes (its F.linear wrapper, "
         "engine.pipeline_parallelism)"),
    Rule(INTERNAL, r"_reentrant_activation_checkpointing",
         "the test calls a private method of DeepSpeed's pipeline engine"),
    Rule(INTERNAL, r"expected native-pinned optimizer offload buffers",
         "the test counts DeepSpeed's registry of natively pinned offload buffers"),
    Rule(INTERNAL, r"has no attribute 'log_level'",
         "log_level sets DeepSpeed's own logger; Zero3D reads the key and leaves it (no engine.log_level())"),
    # DeepSpeed features Zero3D refuses with a message
    Rule(UNSUPPORTED, r"partitioned by deepspeed\.zero\.Init",
         "a model partitioned by deepspeed.zero.Init (build it on the meta device instead)"),
    Rule(UNSUPPORTED, r"offload_param with device \\?\"cpu\\?\" needs (ZeRO stage 3|at least 2 ranks)",
         "offload_param below stage 3 or with one data-parallel rank (nothing sharded to offload)"),
    Rule(UNSUPPORTED, r"TestIncorectAllgatherBucketSize.*\n.*DID NOT RAISE",
         "DeepSpeed asserts allgather_bucket_size is a multiple of NCCL's alignment; Zero3D's buffers take any size, "
         "so it has no reason to refuse it"),
    Rule(UNSUPPORTED, r"DID NOT RAISE ZeRORuntimeException",
         "DeepSpeed refuses a torch optimizer under offload_optimizer with zero_force_ds_cpu_optimizer (it insists on "
         "its CPU Adam); Zero3D steps any torch optimizer on the CPU"),
    Rule(UNSUPPORTED, r"TestNoModel::test\n.*DID NOT RAISE",
         "initialize(model, config=...): Zero3D's first positional argument is the model, DeepSpeed's is args "
         "(so there the model is missing); DeepSpeed's keywords work in both"),
    Rule(UNSUPPORTED, r"unknown config key 'optimizer\.torch_adam'",
         "torch_adam beside the optimizer's type, where DeepSpeed ignores it (it reads optimizer.params.torch_adam); "
         "Zero3D refuses a key it would ignore, naming the keys it knows"),
    Rule(UNSUPPORTED, r"expert_parallel is a DeepSpeed key Zero3D does not implement",
         "expert parallelism (AutoEP): not implemented, refused with a message"),
    Rule(UNSUPPORTED, r"Direct calls to tensor\.backward\(\) bypass the engine|has no attribute 'scale'",
         "DeepSpeed's user-driven backward (loss.backward() or engine.scale(loss).backward() at stage 3, its "
         "managed gradient accumulation): Zero3D reduces gradients in engine.backward(loss) only and refuses a "
         "gradient that arrives outside it, with a message"),
    Rule(UNSUPPORTED, r"coalesce_grad_reduction",
         "engine.coalesce_grad_reduction() (DeepSpeed's context that merges several backward passes' reductions) is "
         "not implemented"),
    Rule(UNSUPPORTED, r"the ranks were started with different settings: model parameter",
         "a model each rank builds differently (DeepSpeed's PipelineModule builds only its stage's layers); Zero3D "
         "splits one whole model itself (pipeline.stages) and refuses ranks whose models differ"),
    Rule(UNSUPPORTED, r"unknown config key 'pipeline\.",
         "a key of DeepSpeed's PipelineModule/PipelineEngine that Zero3D's pipeline section does not have, refused "
         "with the keys it knows"),
    Rule(UNSUPPORTED, r"is a DeepSpeed key Zero3D does not implement",
         "a DeepSpeed config key Zero3D does not implement, refused with a message naming it"),
    Rule(UNSUPPORTED, r"is a DeepSpeed optimizer Zero3D does not implement",
         "a DeepSpeed optimizer type Zero3D does not implement (Adam, AdamW and SGD are), refused with a message"),
    Rule(UNSUPPORTED, r"(ConfigError|UsageError): [^\n]* is not supported",
         "a DeepSpeed feature or argument Zero3D refuses with a message saying what it allows"),
    Rule(UNSUPPORTED, r"engine\.step\(\) without engine\.backward",
         "gradients assigned to .grad by the script, then engine.step() without engine.backward() (Zero3D's "
         "gradients come from its backward hooks; refused with a message)"),
)
"""The first match wins; the patterns name DeepSpeed's objects or Zero3D's refusal messages."""


def classify(test: str, reason: str) -> tuple[str, str]:
    """(class, why) of one failure."""
    text = f"{test}\n{reason}"
    for rule in RULES:
        if re.search(rule.pattern, text):
            return rule.cls, rule.why
    return UNCLASSIFIED, ""


def _short(reason: str, limit: int = 220) -> str:
    text = " ".join(reason.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _counts(results: dict) -> collections.Counter:
    counts = collections.Counter()
    for test, r in results.items():
        if r["outcome"] in ("passed", "not run"):
            counts[r["outcome"]] += 1
        else:
            counts[classify(test, r["reason"])[0]] += 1
    return counts


def print_report(report: dict, out: TextIO) -> None:
    """Plain-text report of one run: totals, per file, every failure with its class."""
    total = sum(len(r) for r in report.values())
    passed = sum(r["outcome"] == "passed" for rs in report.values() for r in rs.values())
    print(f"DeepSpeed unit tests through Zero3D: {passed} of {total} pass", file=out)
    print("\nper file (passed / subset):", file=out)
    for file, results in report.items():
        ok = sum(r["outcome"] == "passed" for r in results.values())
        print(f"  {ok:4d} / {len(results):<4d} {file}", file=out)
    print("\nfailures:", file=out)
    for results in report.values():
        for test, r in results.items():
            if r["outcome"] not in ("passed", "not run"):
                cls, _ = classify(test, r["reason"])
                print(f"  {test}\n      [{cls}] {r['outcome']}: {_short(r['reason'], 300)}", file=out)


def markdown(report: dict, rev: str, measured_with: dict, unmeasured: Sequence[str] = ()) -> str:
    """The generated section of docs/deepspeed.md over every pinned file (``unmeasured``: selected
    files whose subset is not pinned yet)."""
    selected = sum(len(r) for r in report.values())
    totals = collections.Counter()
    for results in report.values():
        totals += _counts(results)
    commits = sorted({r.get("commit", "") for rs in report.values() for r in rs.values()} - {""})
    env = ", ".join(f"{k} {v}" for k, v in measured_with.items())
    lines = [
        f"Generated by `scripts/ds_unit_tests.py --docs` from the stored results; DeepSpeed's tests at "
        f"{rev[:8]}, the subset pinned in `scripts/ds_unit_subset.json` (measured with {env}; "
        f"{len(report) + len(unmeasured)} files selected, {sum(bool(r) for r in report.values())} with tests in "
        f"the subset). "
        f"Zero3D commit(s) of the results: {', '.join(commits) or 'none'} (`+`: with uncommitted changes).",
        "",
        f"**{totals['passed']} of {selected} pass**; failed: {totals[INTERNAL]} {INTERNAL}, "
        f"{totals[UNSUPPORTED]} {UNSUPPORTED}, {totals[WRONG]} {WRONG}, {totals[UNCLASSIFIED]} {UNCLASSIFIED}; "
        f"not run yet: {totals['not run']}.",
        "",
        f"| file | subset | passed | {INTERNAL} | {UNSUPPORTED} | {WRONG} | {UNCLASSIFIED} | not run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for file, results in report.items():
        if not results:
            continue
        c = _counts(results)
        lines.append(f"| `{file}` | {len(results)} | {c['passed']} | {c[INTERNAL]} | {c[UNSUPPORTED]} | "
                     f"{c[WRONG]} | {c[UNCLASSIFIED]} | {c['not run']} |")
    empty = [f for f, r in report.items() if not r]
    lines += ["", f"Files with no test in the subset ({len(empty)}): " + (", ".join(f"`{f}`" for f in empty) or "none") + "."]
    if unmeasured:
        lines += ["", f"**Selected files whose subset is not measured yet ({len(unmeasured)})**: "
                  + ", ".join(f"`{f}`" for f in unmeasured) + "."]
    lines += ["", "Every failure (class, why, the message):", ""]
    for file, results in report.items():
        groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for test, r in results.items():
            if r["outcome"] not in ("passed", "not run"):
                cls, why = classify(test, r["reason"])
                groups.setdefault((cls, why or _short(r["reason"])), []).append((test.split("::", 1)[1], r["reason"]))
        if not groups:
            continue
        lines.append(f"- `{file}`")
        for (cls, why), tests in groups.items():
            names = ", ".join(f"`{name}`" for name, _ in tests)
            example = _short(tests[0][1]).replace("`", "'")
            lines.append(f"  - **{cls}** ({len(tests)}): {why}. Tests: {names}. Message: `{example}`")
    return "\n".join(lines) + "\n"


def write_docs(path: Path, report: dict, rev: str, measured_with: dict, unmeasured: Sequence[str] = ()) -> None:
    """Replace the text between the report markers in ``path`` by the generated report."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no '{BEGIN}' ... '{END}' markers to write the report between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{markdown(report, rev, measured_with, unmeasured)}{END}{tail}")
