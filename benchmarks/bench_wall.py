"""Wall time of ``runner bench`` now against an earlier revision, side by side, with the same spec and defaults.

Usage::

    python benchmarks/bench_wall.py                          # vs c36992b (a fresh process per configuration)
    python benchmarks/bench_wall.py --before main --runs 5 experiments/digits_mlp.toml

The earlier revision is exported with ``git archive`` into a temporary folder. Each run is a whole
``python -m runner bench SPEC --json`` process with its own fresh sqlite store; the two sides
alternate (before, now, before, now, ...) so that load on the machine hits both alike. Printed:
the wall seconds of every run, the best and the median per side, the ratios now / before of both
(target <= 0.40 for the default configurations; the best runs are the least disturbed by other
load), the load average around the runs, and whether both sides report the
same figures: the same configurations, statuses and figure names, and equal final losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "c36992b"  # the last revision that started a fresh process per configuration
FIGURES = ("samples_per_s", "step_time_median_s", "step_time_p90_s", "data_wait_fraction", "peak_memory_bytes")


def _export(rev: str, target: Path) -> Path:
    archive = target / "before.tar"
    with archive.open("wb") as fh:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=fh, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target / "before", filter="data")
    return target / "before"


def _bench(source: Path, spec: Path, work: Path, extra: list[str]) -> tuple[float, dict]:
    """One ``runner bench`` process of ``source``; returns (wall seconds, its JSON report)."""
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(source), "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db"}
    argv = [sys.executable, "-m", "runner", "bench", str(spec), "--json", "--out", str(work / "out"), *extra]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"runner bench failed ({source}):\n{done.stderr[-2000:]}")
    return wall, json.loads(done.stdout)


def _same_figures(a: dict, b: dict) -> list[str]:
    """Differences between two reports in what they report (not in the timings themselves)."""
    rows_a = {c["config"]: c for c in a["configurations"]}
    rows_b = {c["config"]: c for c in b["configurations"]}
    problems = [] if list(rows_a) == list(rows_b) else [f"configurations {list(rows_a)} vs {list(rows_b)}"]
    for name in set(rows_a) & set(rows_b):
        x, y = rows_a[name], rows_b[name]
        if x["status"] != y["status"]:
            problems.append(f"{name}: status {x['status']} vs {y['status']}")
        elif x["status"] == "ok":
            problems += [f"{name}: no {k}" for k in FIGURES if (x.get(k) is None) != (y.get(k) is None)]
            if x["final_loss"] != y["final_loss"]:
                problems.append(f"{name}: final loss {x['final_loss']} vs {y['final_loss']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(ROOT / "experiments" / "digits_mlp.toml"))
    parser.add_argument("--before", default=BEFORE, metavar="REV", help=f"earlier revision (default {BEFORE})")
    parser.add_argument("--runs", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra argument for both sides")
    args = parser.parse_args(argv)
    spec = Path(args.spec).resolve()
    walls: dict[str, list[float]] = {"before": [], "now": []}
    reports: dict[str, dict] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-wall-") as tmp:
        sources = {"before": _export(args.before, Path(tmp)), "now": ROOT}
        for i in range(args.runs):
            for side in ("before", "now"):
                wall, report = _bench(sources[side], spec, Path(tmp) / f"{side}-{i}", args.extra)
                walls[side].append(wall)
                reports[side] = report
                print(f"run {i + 1} {side:<6} {wall:6.1f} s", flush=True)
    load.append(os.getloadavg()[0])
    before, now = (statistics.median(walls[s]) for s in ("before", "now"))
    best_before, best_now = min(walls["before"]), min(walls["now"])
    print(f"\nspec {spec.relative_to(ROOT) if spec.is_relative_to(ROOT) else spec}, runs per side {args.runs}")
    print(f"wall before ({args.before}): best {best_before:.1f} s, median {before:.1f} s")
    print(f"wall now: best {best_now:.1f} s, median {now:.1f} s")
    print(f"ratio now / before: best {best_now / best_before:.2f}, median {now / before:.2f} (target <= 0.40)")
    print(f"load average (1 min) before / after the runs: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores")
    problems = _same_figures(reports["before"], reports["now"])
    print("same figures: yes" if not problems else "same figures: NO\n  " + "\n  ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
