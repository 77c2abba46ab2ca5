"""scripts/gpu_check.py cannot rot: on CPU (gloo) every case it runs on a GPU passes on two ranks
with the tiny benchmark model, against the same single-process oracle."""

from __future__ import annotations

import os
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _checks() -> list[dict]:
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import gpu_check

    return gpu_check.run_checks("T")


def test_every_gpu_check_case_passes_on_cpu(dist):
    results = dist.run(2, _checks, timeout=240)
    for rank, rows in enumerate(results):
        assert len(rows) == 14, [r["case"] for r in rows]  # 11 cases of any world size, offload_param, tp, pp
        for row in rows:
            assert row["ok"], f"rank {rank} {row['case']}: {row['errors']} {row['error'] or ''}"
