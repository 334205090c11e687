"""Overhead of runner over a plain hand-written PyTorch loop: same model, data, sampler, batch and seed.

Both sides train an MLP (784 -> 512 -> 512 -> 10 by default) on seeded synthetic 784-dim
inputs, batch 256, SGD with momentum, on one device (CPU here, the first GPU when
``--accelerator cuda``). The hand-written side is the loop everyone writes (zero_grad,
forward, ``F.cross_entropy``, backward, step, ``loss.item()`` every step) over a DataLoader with
runner's own :class:`runner.training.sampling.EpochSampler` and dataset, so both see the very same
batches; runner runs ``runner.launch.driver.exec_experiment`` with per-step MLflow logging
(``log_every_n_steps = 1``) into a temporary sqlite store.

Only training after warm-up is timed: from the end of step ``warmup`` to the end of step
``warmup + steps`` (runner: the MLflow timestamps of ``train/loss`` at those two steps, which
runner takes when the step is logged; hand-written: ``time.perf_counter`` at the same points).
Start-up (imports, MLflow run creation, data building) is not counted. Each side runs
``--repeat`` times, alternating, and the best time of each is kept (the least disturbed by
other load on the machine).

Usage::

    python benchmarks/overhead.py                       # 300 timed steps after 20 warm-up, best of 2
    python benchmarks/overhead.py --steps 500 --repeat 3 --json overhead.json

Prints one line per run, then the ratio runner / hand-written (target: <= 1.03) and whether the
final losses agree (they should: same batches, same initialisation, same arithmetic).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

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
ids = [0]

[optim]
name = "sgd"
lr = 0.01
momentum = 0.9

[train]
epochs = {epochs}
max_steps = {max_steps}
log_every_n_steps = 1
progress = "off"

[checkpoint]
enabled = false

[tracking]
uri = "sqlite:///{store}"
experiment = "overhead"
"""


def hand_written(loaded: Any, warmup: int, steps: int) -> tuple[float, float]:
    """Train with a plain loop; return (seconds for the timed steps, loss of the last step)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from runner.training.data import build_datasets
    from runner.training.models import build_model
    from runner.training.sampling import EpochSampler

    spec = loaded.spec
    device = torch.device("cuda:0" if spec.devices.accelerator == "cuda" else "cpu")
    bundle = build_datasets(spec, loaded.path.parent)
    torch.manual_seed(spec.seed)
    model = build_model(
        spec.model, loaded.path.parent, input_shape=bundle.info.input_shape, num_classes=bundle.info.num_classes
    )
    model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.optim.lr, momentum=spec.optim.momentum)
    n = len(bundle.train)
    sampler = EpochSampler(n, 1, 0, spec.seed, spec.data.shuffle, spec.data.batch_size, spec.data.drop_last)
    loader = DataLoader(bundle.train, batch_size=spec.data.batch_size, sampler=sampler)
    total = warmup + steps
    step, start, loss_value = 0, 0.0, float("nan")
    epoch = 0
    while step < total:
        sampler.set_epoch(epoch)
        for x_cpu, y_cpu in loader:
            x, y = x_cpu.to(device, non_blocking=True), y_cpu.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()  # what a hand-written loop logs every step
            step += 1
            if step == warmup:
                start = time.perf_counter()
            if step == total:
                break
        epoch += 1
    return time.perf_counter() - start, loss_value


def with_runner(loaded: Any, warmup: int, steps: int) -> tuple[float, float]:
    """Train with ``exec_experiment``; return (seconds for the timed steps, loss of the last step)."""
    from mlflow.tracking import MlflowClient

    from runner.launch.driver import exec_experiment

    result = exec_experiment(loaded)
    history = {m.step: m for m in MlflowClient(result.tracking_uri).get_metric_history(result.run_id, "train/loss")}
    first, last = history[warmup], history[warmup + steps]
    return (last.timestamp - first.timestamp) / 1000.0, float(last.value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed optimizer steps (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side; the best counts (default 2)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--hidden", default="512,512", help="MLP hidden sizes (default 512,512)")
    parser.add_argument("--samples", type=int, default=16384, help="synthetic samples (default 16384)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"], help="device (default cpu)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)

    from runner.spec.loading import load_spec

    total = args.warmup + args.steps
    results: dict[str, list[float]] = {"hand-written": [], "runner": []}
    losses: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="runner-overhead-") as tmp:
        path = Path(tmp) / "overhead.toml"
        path.write_text(
            SPEC.format(
                hidden=json.dumps([int(h) for h in args.hidden.split(",")]),
                samples=args.samples,
                batch=args.batch,
                accelerator=args.accelerator,
                epochs=total,
                max_steps=total,
                store=Path(tmp) / "mlflow.db",
            ),
            encoding="utf-8",
        )
        loaded = load_spec(path)
        for i in range(args.repeat):
            for name, fn in (("hand-written", hand_written), ("runner", with_runner)):
                seconds, loss = fn(loaded, args.warmup, args.steps)
                results[name].append(seconds)
                losses[name] = loss
                print(
                    f"{name:<13} run {i + 1}: {seconds:8.3f} s for {args.steps} steps "
                    f"({args.steps * args.batch / seconds:9.1f} samples/s), final loss {loss:.6f}",
                    flush=True,
                )
    best = {k: min(v) for k, v in results.items()}
    ratio = best["runner"] / best["hand-written"]
    agree = abs(losses["runner"] - losses["hand-written"]) <= 1e-4 * max(abs(losses["runner"]), 1e-12)
    print(f"best: hand-written {best['hand-written']:.3f} s, runner {best['runner']:.3f} s")
    print(f"ratio runner / hand-written = {ratio:.3f}  (target <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})")
    print(
        f"final losses {'agree' if agree else 'DIFFER'}: "
        f"runner {losses['runner']:.6f}, hand-written {losses['hand-written']:.6f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "seconds": results,
                    "best": best,
                    "ratio": ratio,
                    "final_loss": losses,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "batch": args.batch,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
