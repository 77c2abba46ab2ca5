"""The coverage tables (README.md) and counts (docs) from ``docs/coverage.jsonl`` and
``docs/coverage_composed.jsonl``; see ``scripts/coverage.py``."""

from __future__ import annotations

import re
from pathlib import Path

from coverage_check import LAYOUTS

HEADERS = {"zero3": "ZeRO-3, dp 2", "tp2": "tp 2", "pp2": "pp 2", "pp2-tp2": "pp 2 x tp 2, ZeRO-1",
           "pp2-dp2-z3": "pp 2 x dp 2, ZeRO-3", "tp2-dp2-z3": "tp 2 x dp 2, ZeRO-3",
           "tp2-sp": "tp 2, sequence parallel", "pp2-tp2-sp": "pp 2 x tp 2, sequence parallel",
           "pp2-dp2-z2": "pp 2 x dp 2, ZeRO-2", "cp2-ring": "cp 2, ring attention",
           "cp2-dp2-z3-ring": "cp 2 x dp 2, ZeRO-3, ring attention"}
KINDS = ("pass", "refused", "fail", "skip")


def _header(layout: str) -> str:
    """A layout's column title; a resumed one ``A>B`` as "A, resumed as B"."""
    first, _, second = layout.partition(">")
    return HEADERS[first] + (f", resumed as {HEADERS[second]}" if second else "")


def _kind(outcome: str) -> str:
    return outcome.split(":", 1)[0].strip()


def _plan_of(model_type: str) -> str:
    """Where the type's pipeline plan comes from: HF's config, a zero3d record, or nowhere."""
    from transformers import AutoConfig

    from models.families import family_record

    try:
        config = AutoConfig.for_model(model_type).get_text_config()
    except Exception:  # noqa: BLE001 - a config transformers cannot build has no plan to read
        return "-"
    if getattr(config, "base_model_pp_plan", None):
        return "HF"
    return "zero3d" if family_record(config).pp_plan else "-"


def counts(results: dict[str, dict[str, str]], layouts: tuple[str, ...] = LAYOUTS) -> dict[str, dict[str, int]]:
    """Per layout: how many types pass, are refused, fail, are skipped."""
    out = {layout: dict.fromkeys(KINDS, 0) for layout in layouts}
    for outcomes in results.values():
        for layout in layouts:
            if layout in outcomes:
                out[layout][_kind(outcomes[layout])] += 1
    return out


def counts_text(results: dict[str, dict[str, str]], types: list[str]) -> str:
    import transformers

    c = counts(results)
    older = sorted({r["transformers"] for r in results.values() if "transformers" in r})
    carried = sum(1 for r in results.values() if "transformers" in r)
    lines = [f"transformers {transformers.__version__}: {len(results)} of its {len(types)} causal-LM types tried"
             + (f"; {carried} of them not yet under {transformers.__version__}: their rows carry the results of "
                f"transformers {', '.join(older)}, marked in the table." if carried else "."), ""]
    lines += counts_rows(c)
    planned = [t for t in results if _plan_of(t) == "HF"]
    trained = [t for t in planned if all(_kind(results[t].get(layout, "")) == "pass" for layout in LAYOUTS)]
    refused = [t for t in planned if t not in trained and all(
        _kind(results[t].get(layout, "")) in ("pass", "refused") for layout in LAYOUTS)]
    others = sorted(set(planned) - set(trained) - set(refused))
    lines += ["", f"Of the {len(planned)} tried types whose config ships `base_model_pp_plan`: {len(trained)} train under "
              f"all three layouts, {len(refused)} are refused under some with the reason below"
              + (f", and {len(others)} fail or are skipped: {', '.join(others)}." if others else ".")]
    return "\n".join(lines)


def counts_rows(c: dict[str, dict[str, int]]) -> list[str]:
    return (["| layout | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
            + [f"| {_header(layout)} | " + " | ".join(str(row[k]) for k in KINDS) + " |" for layout, row in c.items()])


def table_text(results: dict[str, dict[str, str]], types: list[str], layouts: tuple[str, ...] = LAYOUTS) -> str:
    """The table, each distinct reason once as a numbered note under it."""
    notes: dict[str, int] = {}

    def cell(outcome: str | None) -> str:
        if outcome is None:
            return "not run"
        kind = _kind(outcome)
        if kind == "pass":
            return "pass"
        reason = outcome.split(":", 1)[1].strip().replace("|", "\\|")
        number = notes.setdefault(reason, len(notes) + 1)
        return f"{kind} [{number}]"

    rows = ["| type | pp plan | " + " | ".join(_header(layout) for layout in layouts) + " |",
            "|---|---|" + "---|" * len(layouts)]
    for model_type in types:
        if model_type in results:
            outcomes = results[model_type]
            old = f" ({outcomes['transformers']})" if "transformers" in outcomes else ""
            rows.append(f"| `{model_type}`{old} | {_plan_of(model_type)} | "
                        + " | ".join(cell(outcomes.get(layout)) for layout in layouts) + " |")
    rows += [""] + [f"{n}. {reason}" for reason, n in notes.items()]
    return "\n".join(rows)


def _replace(path: Path, begin: str, end: str, text: str) -> None:
    body = path.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(body):
        raise SystemExit(f"{path} has no {begin} ... {end} markers")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", body))


def write_table(results: dict[str, dict[str, str]], readme: Path, begin: str, end: str, types: list[str]) -> None:
    """README's table and counts between ``begin`` and ``end``; the counts also in docs/pipeline.md."""
    summary = counts_text(results, types)
    _replace(readme, begin, end, "Generated by `python scripts/coverage.py --table`; do not edit.\n\n" + summary
             + "\n\n" + table_text(results, types))
    _replace(readme.parent / "docs" / "pipeline.md", begin, end, summary)
    print(summary)


def write_composed_table(results: dict[str, dict[str, str]], readme: Path, begin: str, end: str,
                         layouts: tuple[str, ...], options: str) -> None:
    """A README table of a run with ``options``: the counts, and a row for every type that trains
    under at least one of ``layouts`` or fails under one (the others are refused or skipped under
    all, for the reasons the first table gives)."""
    import transformers

    shown = [t for t, outcomes in results.items()
             if any(_kind(outcomes.get(layout, "")) in ("pass", "fail") for layout in layouts)]
    summary = "\n".join([f"transformers {transformers.__version__}: {len(results)} causal-LM types tried.", "",
                         *counts_rows(counts(results, layouts))])
    _replace(readme, begin, end, f"Generated by `python scripts/coverage.py {options} --table`; do not edit.\n\n"
             + summary + "\n\n" + table_text(results, sorted(shown), layouts))
    print(summary)
