"""Steady-state overhead of runner over a plain hand-written PyTorch loop: same model, data, sampler, batch and seed.

Both sides train an MLP (784 -> 512 -> 512 -> 10 by default) on seeded synthetic 784-dim
inputs, global batch 256, SGD with momentum, on one device (CPU here, the first GPU when
``--accelerator cuda``), and under ``--modes ddp`` with 2 processes over gloo (nccl on GPUs). The
hand-written side is the loop everyone writes (zero_grad, forward, ``F.cross_entropy``, backward,
step, the mean loss read back at each log step; ddp: ``DistributedDataParallel`` started with
``torch.multiprocessing.spawn``, rank 0 reading its own loss) over a DataLoader with runner's own
:class:`runner.training.sampling.EpochSampler` and dataset, so both see the very same batches;
runner runs ``runner.launch.driver.exec_experiment`` logging every 10 steps and, in a second
measurement, every step (``--log-every``: the rank-reduced ``train/loss`` and ``lr``) into a
temporary sqlite store. Both sides train with the same CPU threads per process: runner's rule
(usable cores // processes, docs/design.md §3), which the hand-written side applies too.

Only training after warm-up is timed: from the end of step ``warmup`` to the end of step
``warmup + steps`` (runner: the MLflow timestamps of ``train/loss`` at those two steps, which
runner takes when the step is logged; hand-written: ``time.perf_counter`` on rank 0 at the same
points). Start-up (imports, MLflow run creation, data building, process start) is not counted.
The sides alternate (hand-written, runner, hand-written, ...) ``--repeat`` times per mode and the
median of each side is compared, so both see the same load.

Usage::

    python benchmarks/overhead.py                          # none and ddp, 64 timed steps after 20, 5 repeats
    python benchmarks/overhead.py --modes none --steps 300 --repeat 7 --json overhead.json

Prints one line per run, then per mode and logging interval the median seconds of each side with
its spread ((max - min) / median), both sides' threads per process, the ratio runner / hand-written
(targets: logging every 10 steps <= 1.03 none, <= 1.05 ddp; every step <= 1.10) and whether the
final losses agree (they should: same batches, same initialisation, same arithmetic; ddp: the hand
side's global mean loss of the last step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

if TYPE_CHECKING:
    from runner.spec.loading import LoadedSpec

TARGETS = {("none", 10): 1.03, ("ddp", 10): 1.05, ("none", 1): 1.10, ("ddp", 1): 1.10}
SPEC = """
name = "overhead"
seed = 0

[model]
name = "mlp"
kwargs = {{ hidden = {hidden} }}

[data]
dataset = "synthetic"
num_samples = {samples}
input_shape = [784]
num_classes = 10
batch_size = {batch}
val_fraction = 0.0

[devices]
accelerator = "{accelerator}"
ids = {ids}

[parallel]
mode = "{mode}"
nproc_per_node = {nproc}

[optim]
name = "sgd"
lr = 0.01
momentum = 0.9

[train]
epochs = {epochs}
max_steps = {max_steps}
log_every_n_steps = {log_every}
progress = "off"

[checkpoint]
enabled = false

[tracking]
uri = "sqlite:///{store}"
experiment = "overhead"
"""


def hand_written(loaded: LoadedSpec, warmup: int, steps: int, rank: int = 0, world: int = 1) -> tuple[float, float]:
    """Train with a plain loop on ``rank`` of ``world``; return (seconds for the timed steps, last logged loss).

    It logs as a hand-written loop does every ``log_every_n_steps`` steps: the mean loss of the steps
    since the last log, read back then (``.item()``). With ``world > 1`` the process group must exist;
    the loss returned is then the global mean of the last window (one all-reduce after the timed
    steps), what runner logs.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from runner.training.data import build_datasets
    from runner.training.models import build_model
    from runner.training.sampling import EpochSampler

    spec = loaded.spec
    cuda = spec.devices.accelerator == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    torch.set_num_threads(threads_of(world))
    bundle = build_datasets(spec, loaded.path.parent)
    torch.manual_seed(spec.seed)
    model = build_model(
        spec.model, loaded.path.parent, input_shape=bundle.info.input_shape, num_classes=bundle.info.num_classes
    )
    model.to(device).train()
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None) if world > 1 else model
    optimizer = torch.optim.SGD(net.parameters(), lr=spec.optim.lr, momentum=spec.optim.momentum)
    n, batch = len(bundle.train), spec.data.batch_size
    sampler = EpochSampler(n, world, rank, spec.seed, spec.data.shuffle, batch, spec.data.drop_last)
    loader = DataLoader(bundle.train, batch_size=batch // world, sampler=sampler)
    total, every = warmup + steps, spec.train.log_every_n_steps
    step, start, epoch = 0, 0.0, 0
    window = torch.zeros((), device=device)
    logged = window
    while step < total:
        sampler.set_epoch(epoch)
        for x_cpu, y_cpu in loader:
            x, y = x_cpu.to(device, non_blocking=True), y_cpu.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            window += loss.detach()
            step += 1
            if step % every == 0:
                logged = window / every
                logged.item()  # what a hand-written loop logs
                window = torch.zeros((), device=device)
            if step == warmup:
                start = time.perf_counter()
            if step == total:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    if world > 1:
        import torch.distributed as dist

        final = logged.clone()
        dist.all_reduce(final)
        return seconds, float(final) / world
    return seconds, float(logged)


def threads_of(world: int) -> int:
    """CPU threads of each of ``world`` training processes by runner's rule (what runner's side uses too)."""
    from runner.devices.inventory import affinity_cores
    from runner.devices.resolve import threads_per_process

    return threads_per_process(0, os.environ, affinity_cores(), world)[0]


def _ddp_rank(rank: int, loaded: LoadedSpec, warmup: int, steps: int, world: int, port: int, out: str) -> None:
    """One process of the hand-written DDP side (``torch.multiprocessing.spawn`` target); rank 0 writes ``out``."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if loaded.spec.devices.accelerator == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        seconds, loss = hand_written(loaded, warmup, steps, rank, world)
        if rank == 0:
            Path(out).write_text(json.dumps([seconds, loss]), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def hand_written_ddp(loaded: LoadedSpec, warmup: int, steps: int) -> tuple[float, float]:
    """The hand-written loop under DDP in ``nproc_per_node`` fresh processes; rank 0's figures."""
    import socket

    import torch.multiprocessing as mp

    world = loaded.spec.parallel.nproc_per_node
    assert isinstance(world, int)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="runner-overhead-ddp-") as tmp:
        out = str(Path(tmp) / "rank0.json")
        try:
            mp.spawn(_ddp_rank, args=(loaded, warmup, steps, world, port, out), nprocs=world, join=True)
        except mp.ProcessExitedException as exc:  # torch 2.14's gloo can abort at exit, after the work is done
            if exc.exit_code >= 0 or not Path(out).is_file():
                raise
            print(f"(hand-written ddp: {exc}, after rank 0 wrote its figures; counted)", file=sys.stderr)
        seconds, loss = json.loads(Path(out).read_text(encoding="utf-8"))
    return float(seconds), float(loss)


def with_runner(loaded: LoadedSpec, warmup: int, steps: int) -> tuple[float, float]:
    """Train with ``exec_experiment``; return (seconds for the timed steps, loss of the last step)."""
    from mlflow.tracking import MlflowClient

    from runner.launch.driver import exec_experiment

    result = exec_experiment(loaded)
    assert result.run_id is not None and result.tracking_uri is not None
    history = {m.step: m for m in MlflowClient(result.tracking_uri).get_metric_history(result.run_id, "train/loss")}
    first, last = history[warmup], history[warmup + steps]
    return (last.timestamp - first.timestamp) / 1000.0, float(last.value)


def _spec_file(folder: Path, mode: str, log_every: int, args: argparse.Namespace) -> Path:
    total = args.warmup + args.steps
    nproc = 2 if mode == "ddp" else 1
    path = folder / f"overhead-{mode}-{log_every}.toml"
    path.write_text(
        SPEC.format(
            hidden=json.dumps([int(h) for h in args.hidden.split(",")]),
            samples=args.samples,
            batch=args.batch,
            accelerator=args.accelerator,
            ids=json.dumps(list(range(nproc))) if args.accelerator == "cuda" else "[0]",
            mode=mode,
            nproc=nproc,
            epochs=total,
            max_steps=total,
            store=folder / "mlflow.db",
            log_every=log_every,
        ),
        encoding="utf-8",
    )
    return path


def measure_mode(mode: str, log_every: int, folder: Path, args: argparse.Namespace) -> dict[str, object]:
    """Alternate the two sides ``args.repeat`` times; return their seconds, medians, spreads, ratio, losses, threads."""
    from runner.spec.loading import load_spec

    loaded = load_spec(_spec_file(folder, mode, log_every, args))
    sides = {"hand-written": hand_written_ddp if mode == "ddp" else hand_written, "runner": with_runner}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, float] = {}
    tag = f"{mode} log/{log_every}"
    for i in range(args.repeat):
        for name, fn in sides.items():
            took, loss = fn(loaded, args.warmup, args.steps)
            seconds[name].append(took)
            losses[name] = loss
            print(
                f"{tag:<11} {name:<13} run {i + 1}: {took:8.3f} s for {args.steps} steps "
                f"({args.steps * args.batch / took:9.1f} samples/s), final loss {loss:.6f}",
                flush=True,
            )
    median = {k: statistics.median(v) for k, v in seconds.items()}
    spread = {k: (max(v) - min(v)) / median[k] for k, v in seconds.items()}
    ratio = median["runner"] / median["hand-written"]
    agree = abs(losses["runner"] - losses["hand-written"]) <= 1e-4 * max(abs(losses["runner"]), 1e-12)
    threads = threads_of(2 if mode == "ddp" else 1)
    print(
        f"{tag}: median hand-written {median['hand-written']:.3f} s (spread {spread['hand-written']:.0%}), "
        f"runner {median['runner']:.3f} s (spread {spread['runner']:.0%}); threads per process: both {threads}"
    )
    target = TARGETS.get((mode, log_every))
    verdict = "" if target is None else f"  (target <= {target}: {'met' if ratio <= target else 'NOT met'})"
    print(f"{tag}: ratio runner / hand-written = {ratio:.3f}{verdict}")
    paired = sorted(r / h for r, h in zip(seconds["runner"], seconds["hand-written"], strict=True))
    print(  # each runner run against the hand-written run just before it: the VM's slow drift cancels
        f"{tag}: paired ratios (runner run i / hand-written run i): median {statistics.median(paired):.3f}, "
        f"range {paired[0]:.3f}-{paired[-1]:.3f}"
    )
    print(
        f"{tag}: final losses {'agree' if agree else 'DIFFER'}: "
        f"runner {losses['runner']:.6f}, hand-written {losses['hand-written']:.6f}",
        flush=True,
    )
    return {
        "seconds": seconds,
        "median": median,
        "spread": spread,
        "ratio": ratio,
        "paired_ratios": paired,
        "final_loss": losses,
        "agree": agree,
        "threads_per_process": threads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="none,ddp", help="none, ddp or both (default none,ddp; ddp: 2 processes)")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps (default 60)")
    parser.add_argument("--log-every", default="10,1", help="logging intervals to measure (default 10,1)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per side; the median counts (default 5)")
    parser.add_argument("--batch", type=int, default=256, help="global batch size (default 256)")
    parser.add_argument("--hidden", default="512,512", help="MLP hidden sizes (default 512,512)")
    parser.add_argument("--samples", type=int, default=16384, help="synthetic samples (default 16384)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"], help="device (default cpu)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPU core(s); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    intervals = [int(n) for n in args.log_every.split(",") if n]
    if any(args.warmup % n or args.steps % n for n in intervals):
        parser.error(
            "--warmup and --steps must be multiples of every --log-every interval (runner's side is timed "
            "at its log steps)"
        )
    figures = {}
    with tempfile.TemporaryDirectory(prefix="runner-overhead-") as tmp:
        for mode in [m for m in args.modes.split(",") if m]:
            for log_every in intervals:
                figures[f"{mode}/{log_every}"] = measure_mode(mode, log_every, Path(tmp), args)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        out = {"modes": figures, "steps": args.steps, "warmup": args.warmup, "batch": args.batch}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0 if all(f["agree"] for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
