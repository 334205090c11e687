"""runner plan's memory estimate beside what the GPU check's runs held: one row per mode, the ratio measured/estimate.

Usage: ``memory_check.py PLAN_JSON`` (``runner plan SPEC --json`` on the same device ids as the runs). The runs are the
top-level FINISHED runs of the store at ``MLFLOW_TRACKING_URI`` in fp32 without ``train.compile`` (the GPU check's
none, dp-1, ddp-1 and fsdp parts); each gives ``memory/peak_allocated_mib/device0``
(``torch.cuda.max_memory_allocated``). The estimate leaves out the CUDA context, the allocator's fragmentation and
cuDNN workspaces (README, "Will it fit?"), so a ratio a little above 1 is expected; a ratio far from 1 is a finding.
A CPU run logs its resident set instead, which is not comparable: the rows then say so.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MIB = 2**20


def measured_peaks(uri: str) -> dict[str, float | None]:
    """Mode -> the newest fp32, uncompiled top-level run's device-0 peak in MiB (``None``: a CPU run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    peaks: dict[str, float | None] = {}
    experiments = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(experiments, "attributes.status = 'FINISHED'", order_by=["attributes.start_time"]):
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        plain = params.get("train.amp", "no") == "no" and params.get("train.compile", "false") == "false"
        if "mlflow.parentRunId" in tags or "runner.parallel_mode" not in tags or not plain:
            continue
        peaks[tags["runner.parallel_mode"]] = metrics.get("memory/peak_allocated_mib/device0")
    return peaks


def main() -> int:
    plan = json.loads(Path(sys.argv[1]).read_text())["memory"]
    peaks = measured_peaks(os.environ["MLFLOW_TRACKING_URI"])
    print(f"{'mode':<6} {'estimate MiB':>13} {'measured MiB':>13} {'ratio':>7}")
    for mode, rows in plan["modes"].items():
        estimate = rows[0]["peak"] / MIB  # device 0 (dp's first row), or "each" rank
        if mode not in peaks:
            print(f"{mode:<6} {estimate:>13.1f} {'no run':>13}")
        elif peaks[mode] is None:
            print(f"{mode:<6} {estimate:>13.1f} {'CPU run':>13} {'-':>7}  (a resident set: not comparable)")
        else:
            print(f"{mode:<6} {estimate:>13.1f} {peaks[mode]:>13.1f} {peaks[mode] / estimate:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
