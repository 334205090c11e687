"""Time to a finished 1-step run: ``runner exec`` against a plain script doing the same work, as whole processes.

Two pairs are measured, each side as a fresh process, alternating (plain, runner, plain, runner, ...)
so that both see the same load:

* ``none``: ``runner exec experiments/digits_mlp.toml --set train.max_steps=1`` against a plain
  script that imports torch, loads the scikit-learn digits (reading scikit-learn's data file, as runner does,
  without importing scikit-learn), splits them 80/20, builds the same MLP
  (64 -> 128 -> 64 -> 10), takes one SGD step with momentum on a batch of 64 and evaluates the
  validation split;
* ``ddp``: ``runner exec experiments/digits_mlp_ddp.toml --set train.max_steps=1`` (2 processes)
  against ``torchrun --standalone --nproc-per-node 2`` of the same plain script under DistributedDataParallel
  (gloo on CPU, 32 samples per rank).

Runner logs into a sqlite store in a temporary folder that one untimed run of each side creates
first (a user's store exists after the first run; the first open of a new store migrates its
schema, a one-off cost). Each timed run is a whole process from ``exec`` to exit. The resident
set size of every process of the tree is sampled every 20 ms (``psutil``): ``tree`` is the largest
sum seen (ddp: the launcher and both workers); ``driver`` is runner's own process when training
happens in children (its target: <= 300 MiB). ``train`` is the kernel's high-water mark of the
largest process of the tree (``ru_maxrss`` from ``wait4``): a training process, exact, where a
sample every 20 ms missed the plain script's peak at its very end in 3 of 5 runs. Thread counts:
the plain script prints torch's (torchrun sets ``OMP_NUM_THREADS=1`` for 2 processes), runner's
are its plan's ``runner.threads_per_process``. Spread = (max - min) / median of a side's runs.

``--before DIR`` adds a third side, ``runner exec`` of another checkout (an earlier revision),
timed in the same rotation.

Usage::

    python benchmarks/startup.py                      # both pairs, 5 timed runs per side
    python benchmarks/startup.py --modes none --runs 7 --json startup.json
    python benchmarks/startup.py --before /tmp/runner-before   # also an earlier checkout (git archive REV)

Prints one line per run, then per pair the median seconds of each side with its spread, their
ratio (targets: <= 1.25 for none, <= 1.3 for ddp), both sides' threads per training process, the
median peak RSS of a training process on each side and their ratio (target <= 1.05), the driver's,
and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"none": 1.25, "ddp": 1.3}
RSS_TARGET = 1.05  # a training process against the plain script's
DRIVER_TARGET_MIB = 300
SPECS = {"none": "experiments/digits_mlp.toml", "ddp": "experiments/digits_mlp_ddp.toml"}

PLAIN = textwrap.dedent(
    '''
    """One SGD step of the digits MLP, written by hand (under torchrun: DDP over gloo)."""
    import gzip
    import importlib.util
    import os
    from pathlib import Path

    import numpy as np
    import torch
    import torch.nn.functional as F

    ddp = "RANK" in os.environ
    if ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(0)
    sklearn = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    with gzip.open(sklearn / "datasets" / "data" / "digits.csv.gz", "rt") as f:  # what load_digits reads
        table = torch.from_numpy(np.loadtxt(f, delimiter=","))
    x = table[:, :-1].to(torch.float32).div_(16.0)
    x = (x - x.mean()) / x.std()
    y = table[:, -1].to(torch.long)
    order = torch.randperm(len(x))
    n_val = int(0.2 * len(x))
    val, train = order[:n_val], order[n_val:]
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batch = train[torch.randperm(len(train))[:64]][rank::world]
    loss = F.cross_entropy(net(x[batch]), y[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        logits = model(x[val])
        val_loss = F.cross_entropy(logits, y[val]).item()
        accuracy = (logits.argmax(1) == y[val]).float().mean().item()
    if rank == 0:
        print(f"threads {torch.get_num_threads()}")
        print(f"train/loss {loss.item():.4f} val/loss {val_loss:.4f} val/accuracy {accuracy:.4f}")
    if ddp:
        dist.destroy_process_group()
    '''
)


def _rss(proc: psutil.Process) -> dict[int, int]:
    """Resident bytes by pid of ``proc`` and its children, counting a forked child that has not exec'ed yet (``git``,
    about to replace itself) as nothing: until then it shares every page with its parent."""
    out: dict[int, int] = {}
    try:
        seen = {proc.pid: proc.cmdline()}
        out[proc.pid] = proc.memory_info().rss
        for child in proc.children(recursive=True):
            cmdline = child.cmdline()
            seen[child.pid] = cmdline
            if cmdline != seen.get(child.ppid()):
                out[child.pid] = child.memory_info().rss
    except psutil.Error:  # a process ended between the listing and the read
        pass
    return out


TRAINING_MIB = 200  # a child this large imports torch: a training process (not a resource tracker or git)


def measure(command: list[str], cwd: Path, env: dict[str, str]) -> dict[str, float | str]:
    """Run ``command`` to its end; return its wall seconds, peak RSS (MiB) of the tree (sampled), of its largest
    process (a training process: the kernel's exact high-water mark, ``ru_maxrss`` of the reaped tree) and of the root
    when training happened in children (sampled, else ``0``), and its standard output.

    Raises:
        RuntimeError: The command failed (its standard error is included), other than by a gloo abort at exit.
    """
    start = time.perf_counter()
    proc = psutil.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tree, peaks = 0, {}
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # reaped here: its rusage covers the whole tree
        if pid:
            break
        sizes = _rss(proc)
        tree = max(tree, sum(sizes.values()))
        for child, size in sizes.items():
            peaks[child] = max(peaks.get(child, 0), size)
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout, stderr = (s.decode(errors="replace") for s in proc.communicate())
    if proc.returncode != 0:
        if not ("train/loss" in stdout and "(SIGABRT)" in stderr):
            raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{stderr[-3000:]}")
        # torch 2.14's gloo can abort a rank at interpreter exit, after the work: the run is counted, and said so
        print("(a rank aborted at exit after its step: torch's gloo; counted)", file=sys.stderr)
    root = peaks.pop(proc.pid, 0)
    trained_in_children = any(v > TRAINING_MIB * 2**20 for v in peaks.values())
    largest = usage.ru_maxrss * 1024  # KiB on Linux
    return {
        "seconds": seconds,
        "tree": tree / 2**20,
        "train": largest / 2**20,
        "driver": root / 2**20 if trained_in_children else 0.0,
        "out": stdout,
    }


def spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def runner_threads(mode: str) -> int:
    """Threads per training process that runner's plan gives ``SPECS[mode]`` here (its run's param)."""
    sys.path.insert(0, str(ROOT))
    from runner.plan import make_plan
    from runner.spec.loading import load_spec

    return make_plan(load_spec(ROOT / SPECS[mode], ["train.max_steps=1"])).devices.threads_per_process


def commands(mode: str, script: Path, before: Path | None) -> dict[str, tuple[list[str], Path]]:
    """The sides of one pair: the plain script (torchrun for ddp), ``runner exec``, and that of ``before``.

    Returns:
        Side name -> (command, checkout whose ``runner`` it imports).
    """
    py = sys.executable
    plain = [py, str(script)]
    if mode == "ddp":
        plain = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    sides = {"plain": (plain, ROOT)}
    for side, root in (("runner", ROOT), ("before", before)):
        if root is not None:
            sides[side] = ([py, "-m", "runner", "exec", str(root / SPECS[mode]), "--set", "train.max_steps=1"], root)
    return sides


def _summary(mode: str, sides: dict[str, dict[str, list[float]]], threads: dict[str, int], before: Path | None) -> dict:
    """Print and return one pair's medians, spreads, ratios and thread counts."""
    med = {side: {k: statistics.median(v) for k, v in fig.items()} for side, fig in sides.items()}
    spreads = {side: spread(fig["seconds"]) for side, fig in sides.items()}
    ratio = med["runner"]["seconds"] / med["plain"]["seconds"]
    rss_ratio = med["runner"]["train"] / med["plain"]["train"]
    print(
        f"{mode}: median plain {med['plain']['seconds']:.2f} s (spread {spreads['plain']:.0%}), runner "
        f"{med['runner']['seconds']:.2f} s (spread {spreads['runner']:.0%}); ratio {ratio:.3f} "
        f"(target <= {TARGETS[mode]}: {'met' if ratio <= TARGETS[mode] else 'NOT met'})"
    )
    print(f"{mode}: threads per training process: plain {threads.get('plain')}, runner {threads['runner']}")
    print(
        f"{mode}: median peak RSS of a training process: plain {med['plain']['train']:.0f} MiB, runner "
        f"{med['runner']['train']:.0f} MiB; ratio {rss_ratio:.3f} "
        f"(target <= {RSS_TARGET}: {'met' if rss_ratio <= RSS_TARGET else 'NOT met'}); whole tree: plain "
        f"{med['plain']['tree']:.0f} MiB, runner {med['runner']['tree']:.0f} MiB"
    )
    if med["runner"]["driver"]:
        driver = med["runner"]["driver"]
        verdict = "met" if driver <= DRIVER_TARGET_MIB else "NOT met"
        print(f"{mode}: runner's driver process peak RSS {driver:.0f} MiB (target <= {DRIVER_TARGET_MIB}: {verdict})")
    out = {"median": med, "spread": spreads, "ratio": ratio, "rss_ratio": rss_ratio, "threads": threads}
    if "before" in med:
        out["before_ratio"] = med["before"]["seconds"] / med["plain"]["seconds"]
        print(f"{mode}: before ({before}) median {med['before']['seconds']:.2f} s; ratio {out['before_ratio']:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per side (default 5)")
    parser.add_argument("--modes", default="none,ddp", help="pairs to measure (default none,ddp)")
    parser.add_argument("--before", metavar="DIR", type=Path, help="also time runner exec of the checkout DIR")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH")}
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} CPU core(s); load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    figures: dict[str, dict[str, dict[str, list[float]]]] = {}
    threads: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="runner-startup-") as tmp:
        cwd = Path(tmp)
        script = cwd / "plain_step.py"
        script.write_text(PLAIN, encoding="utf-8")
        for mode in modes:
            sides = commands(mode, script, args.before)
            for command, root in sides.values():  # untimed: creates the store, fills the page cache
                measure(command, cwd, {**base, "PYTHONPATH": str(root)})
            figures[mode] = {side: {k: [] for k in ("seconds", "tree", "train", "driver")} for side in sides}
            threads[mode] = {"runner": runner_threads(mode)}
            for i in range(args.runs):
                for side, (command, root) in sides.items():
                    got = measure(command, cwd, {**base, "PYTHONPATH": str(root)})
                    for key, values in figures[mode][side].items():
                        values.append(float(got[key]))
                    if side == "plain":
                        threads[mode]["plain"] = int(str(got["out"]).split("threads ", 1)[1].split()[0])
                    print(
                        f"{mode:<5} {side:<7} run {i + 1}: {got['seconds']:6.2f} s  peak RSS tree {got['tree']:5.0f}"
                        f" MiB, training process {got['train']:5.0f} MiB, driver {got['driver']:4.0f} MiB",
                        flush=True,
                    )
    load_after = os.getloadavg()
    summary = {mode: _summary(mode, sides, threads[mode], args.before) for mode, sides in figures.items()}
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        out = {"runs": figures, "summary": summary, "threads": threads, "load_before": load_before}
        out["load_after"] = load_after
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
