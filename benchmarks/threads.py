"""One training process on a CPU: 1 intra-op thread against the rule's ``usable cores`` threads, quiet and beside
busy neighbours.

Trains the steady-state MLP of ``overhead.py`` (784 -> 512 -> 512 -> 10, batch 256, SGD with momentum, synthetic
inputs) for ``--steps`` timed steps after 20, in a fresh process per (threads, neighbours) pair, the pairs
alternating ``--repeat`` times. Neighbours are ``python -c "while True: pass"`` processes started before and killed
after each measurement. Prints, per pair, the median step time, its 90th percentile and its slowest step
(milliseconds, pooled over the repeats), and the ratio of 1 thread to the rule's threads: the figures behind
docs/design.md §3 (the thread rule under contention).

Usage::

    python benchmarks/threads.py                    # neighbours 0, 1 and 2; 200 steps; 3 repeats
    python benchmarks/threads.py --neighbours 0,1 --steps 400 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

STEP = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import torch.nn.functional as F
    threads, steps = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
    times = []
    for step in range(20 + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step >= 20:
            times.append(time.perf_counter() - start)
    print(json.dumps(times))
    """
)


def measure(threads: int, neighbours: int, steps: int) -> list[float]:
    """Step times (seconds) of one fresh process with ``threads`` intra-op threads beside ``neighbours`` spinners."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(neighbours)]
    try:
        out = subprocess.run(
            [sys.executable, "-c", STEP, str(threads), str(steps)], capture_output=True, text=True, check=True
        ).stdout
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    return list(json.loads(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--neighbours", default="0,1,2", help="busy neighbour processes to try (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per process (default 200)")
    parser.add_argument("--repeat", type=int, default=3, help="processes per pair (default 3)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} usable core(s); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rule = max(1, cores)  # the thread rule for one process: usable cores // 1
    pairs = [(t, n) for n in (int(v) for v in args.neighbours.split(",")) for t in sorted({1, rule})]
    times: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    for _ in range(args.repeat):
        for threads, neighbours in pairs:
            times[(threads, neighbours)] += measure(threads, neighbours, args.steps)
    medians = {}
    for (threads, neighbours), seen in times.items():
        seen.sort()
        medians[(threads, neighbours)] = statistics.median(seen)
        p90, worst = seen[int(0.9 * (len(seen) - 1))], seen[-1]
        print(
            f"neighbours {neighbours}, {threads} thread(s): median {1e3 * medians[(threads, neighbours)]:.2f} ms, "
            f"p90 {1e3 * p90:.2f} ms, slowest {1e3 * worst:.1f} ms ({len(seen)} steps)"
        )
    for neighbours in sorted({n for _, n in pairs}):
        if rule > 1:
            ratio = medians[(1, neighbours)] / medians[(rule, neighbours)]
            print(f"neighbours {neighbours}: median step with 1 thread / with {rule} = {ratio:.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
