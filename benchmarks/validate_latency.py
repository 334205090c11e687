"""Time ``runner validate`` on the example specs: as a fresh process (what CI sees) and in-process per file.

Usage::

    python benchmarks/validate_latency.py                    # experiments/*.toml, 5 repeats
    python benchmarks/validate_latency.py --repeat 10 a.toml b.toml

Figures are wall-clock milliseconds; the fastest of ``--repeat`` runs is reported (the
least disturbed by other load), with the median beside it. Invalid specs are timed too
(validation still runs to the end) and counted. Exits 0 even when there is nothing to time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _time_process(argv: list[str], repeat: int) -> tuple[list[float], int, str]:
    """Run ``argv`` ``repeat`` times; return wall times in ms, the last exit status and its stderr."""
    times, status, stderr = [], 0, ""
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
        times.append((time.perf_counter() - start) * 1000)
        status, stderr = done.returncode, done.stderr
    return times, status, stderr


def _summary(times: list[float]) -> str:
    return f"best {min(times):8.1f} ms   median {statistics.median(times):8.1f} ms"


def main(argv: list[str] | None = None) -> int:
    """Print subprocess and in-process validation latency.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0 (timing figures are informative; a failing spec does not fail the benchmark).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="spec files (default: experiments/*.toml)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (default: 5)")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or sorted((ROOT / "experiments").glob("*.toml"))
    if not files:
        print("no spec files (experiments/*.toml is empty): nothing to time")
        return 0
    repeat = max(1, args.repeat)
    print(f"{len(files)} spec file(s), {repeat} repeat(s), python {sys.version.split()[0]}")

    base, _, _ = _time_process([sys.executable, "-c", "pass"], repeat)
    print(f"python startup (baseline)           {_summary(base)}")
    imports, _, _ = _time_process([sys.executable, "-c", "import runner.spec.loading"], repeat)
    print(f"python + import runner.spec.loading      {_summary(imports)}")
    cli, status, stderr = _time_process([sys.executable, "-m", "runner", "validate", *map(str, files)], repeat)
    if "No module named runner.__main__" in stderr or "No module named runner" in stderr:
        print("runner validate (subprocess)        skipped: the runner CLI is not importable")
    else:
        print(f"runner validate, all files          {_summary(cli)}   exit status {status}")
        print(f"  per file (incl. startup)          {min(cli) / len(files):8.1f} ms")

    sys.path.insert(0, str(ROOT))
    from runner.errors import SpecError
    from runner.spec.loading import load_spec

    total_best = 0.0
    invalid = 0
    print("in-process load_spec per file (best / median):")
    for path in files:
        times = []
        ok = True
        for _ in range(repeat):
            start = time.perf_counter()
            try:
                load_spec(path)
            except SpecError:
                ok = False
            times.append((time.perf_counter() - start) * 1000)
        invalid += not ok
        total_best += min(times)
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"  {shown!s:40s} {min(times):7.2f} ms  {statistics.median(times):7.2f} ms{'' if ok else '   (invalid)'}")
    print(f"in-process total {total_best:.2f} ms, {total_best / len(files):.2f} ms per file, {invalid} invalid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
