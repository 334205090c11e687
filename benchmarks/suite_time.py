"""Where the test suite's time goes: wall time of the whole suite and of the fast tier, the slowest tests, and the
share of the time spent in multi-process tests (those marked ``integration``).

Runs, one after the other on this machine (nothing else of yours should run; the load average is printed):

1. ``python -m pytest -m "not integration" -q`` (the fast tier; README's inner loop), timed as a whole process;
2. ``python -m pytest -q`` (the whole suite, what ``.ci/run`` runs), timed likewise, with a JUnit XML report
   whose per-test times give the slowest tests and the integration share (the integration tests' ids come
   from ``pytest -m integration --collect-only -q``).

Usage::

    python benchmarks/suite_time.py                 # both; takes as long as the suite
    python benchmarks/suite_time.py --fast-only     # the fast tier alone
    python benchmarks/suite_time.py --json suite.json

Targets (2 quiet cores): the fast tier <= 60 s, the whole suite <= 600 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST_TARGET_S, SUITE_TARGET_S = 60.0, 600.0


def _pytest(*args: str) -> tuple[float, str]:
    """Run pytest in the repository; return (wall seconds, its last output line)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},  # bytecode cached, as in .ci/run
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return wall, lines[-1] if lines else done.stderr[-500:]


def _integration_ids() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "integration", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def _test_times(report: Path) -> tuple[dict[str, float], list[str]]:
    """Per test id (``path::name[param]``), the seconds JUnit recorded (setup, call and teardown together);
    and the ids of the tests that failed or erred."""
    times: dict[str, float] = {}
    failed: list[str] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name', '')}"
        times[test] = float(case.get("time", 0.0))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:  # with the end of its message: where it failed
            failed.append(f"{test}: {(bad.get('message') or '')[-300:]}")
    return times, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast-only", action="store_true", help="time the fast tier alone")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPU core(s); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    out: dict[str, object] = {"load_before": load}
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        fast_s, fast_line = _pytest("-m", "not integration", "-q", f"--junitxml={report}")
        _, fast_failed = _test_times(report)
    met = "met" if fast_s <= FAST_TARGET_S else "NOT met"
    print(f"fast tier: {fast_s:.1f} s (target <= {FAST_TARGET_S:.0f} s: {met}); {fast_line}")
    for test in fast_failed:
        print(f"  failed: {test}")
    out["fast_s"] = fast_s
    if not args.fast_only:
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "junit.xml"
            suite_s, suite_line = _pytest("-q", f"--junitxml={report}")
            times, failed = _test_times(report)
        met = "met" if suite_s <= SUITE_TARGET_S else "NOT met"
        print(f"whole suite: {suite_s:.1f} s (target <= {SUITE_TARGET_S:.0f} s: {met}); {suite_line}")
        for test in failed:
            print(f"  failed: {test}")
        integration = _integration_ids()
        spent = sum(times.values()) or 1.0
        multi = sum(t for test, t in times.items() if test in integration)
        share = f"{len(integration)} tests, {multi:.0f} s, {multi / spent:.0%} of the time"
        print(f"multi-process (integration) tests: {share}")
        print(f"the {args.slowest} slowest tests:")
        for test, seconds in sorted(times.items(), key=lambda kv: -kv[1])[: args.slowest]:
            print(f"  {seconds:7.1f} s  {test}")
        out.update(suite_s=suite_s, failed=failed, integration_s=multi, integration_share=multi / spent, tests=times)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
