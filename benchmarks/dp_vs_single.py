"""Compare training throughput and peak GPU memory of parallel modes (none vs dp) on this machine.

Each mode runs in a fresh process (so CUDA_VISIBLE_DEVICES is narrowed before CUDA
starts, exactly as ``runner exec`` does) through ``runner.devices.resolve`` and
``runner.strategies``, on synthetic data already in host memory, so the numbers
measure the model and the parallel mode, not the data pipeline.

Usage::

    python benchmarks/dp_vs_single.py                       # resnet18, 64x64 images, batch 256
    python benchmarks/dp_vs_single.py --model mlp --steps 20 --json out.json

Prints one row per mode: devices, per-device batch, samples/s (global samples per
second of wall-clock time over the timed steps), ms per step, and peak memory per
device in MiB (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _spec(args: argparse.Namespace, mode: str) -> Any:
    from runner.spec.schema import ExperimentSpec

    ids: Any = "all" if args.ids == "all" else [int(i) for i in args.ids.split(",")]
    if mode == "none" and ids != "all":
        ids = ids[:1]
    return ExperimentSpec.model_validate(
        {
            "name": f"bench-{mode}",
            "model": {"name": args.model},
            "data": {"dataset": "synthetic", "batch_size": args.batch, "num_classes": 10},
            "optim": {"lr": 0.01},
            "devices": {"accelerator": "auto", "ids": ids},
            "parallel": {"mode": mode},
            "train": {"amp": args.amp},
        }
    )


def _model(name: str, image_size: int) -> Any:
    from torch import nn

    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(weights=None, num_classes=10)
    features = 3 * image_size * image_size
    return nn.Sequential(
        nn.Flatten(), nn.Linear(features, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` timed steps in this process with ``args.mode``; return the measurements."""
    from runner.devices.inventory import probe_inventory
    from runner.devices.resolve import apply_device_env, resolve_devices
    from runner.errors import RunnerError

    spec = _spec(args, args.mode)
    try:
        plan = resolve_devices(spec, os.environ, probe_inventory())
        apply_device_env(plan)
    except RunnerError as exc:
        return {"mode": args.mode, "error": str(exc)}

    import torch
    from torch import nn

    from runner.strategies import make_strategy

    strategy = make_strategy(spec.parallel, plan)
    strategy.setup()
    cuda = plan.accelerator == "cuda"
    n_dev = len(plan.requested_ids) if cuda else 0
    torch.manual_seed(0)
    wrapped = strategy.wrap(_model(args.model, args.image_size))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch,))
    if cuda:
        x, y = x.pin_memory(), y.pin_memory()
    amp_dtype = torch.bfloat16 if args.amp == "bf16" else None

    def sync() -> None:
        for i in range(n_dev):
            torch.cuda.synchronize(i)

    start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            for i in range(n_dev):
                torch.cuda.reset_peak_memory_stats(i)
            start = time.perf_counter()
        xb = x.to(strategy.device, non_blocking=True)
        yb = y.to(strategy.output_device, non_blocking=True)
        with torch.autocast(strategy.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = nn.functional.cross_entropy(wrapped(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    sync()
    elapsed = time.perf_counter() - start
    strategy.teardown()
    return {
        "mode": args.mode,
        "model": args.model,
        "devices": [f"{i}:{name}" for i, name in zip(plan.requested_ids, plan.names, strict=False)] or ["cpu"],
        "wrapped": type(wrapped).__name__,
        "global_batch": args.batch,
        "per_device_batch": plan.per_device_batch,
        "steps": args.steps,
        "samples_per_s": args.batch * args.steps / elapsed,
        "ms_per_step": 1000 * elapsed / args.steps,
        "peak_mib": [round(torch.cuda.max_memory_allocated(i) / 2**20, 1) for i in range(n_dev)],
        "final_loss": float(loss.detach()),
        "notes": plan.notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="none,dp", help="comma list of parallel modes to compare (default none,dp)")
    parser.add_argument("--model", choices=["resnet18", "mlp"], default="resnet18")
    parser.add_argument("--batch", type=int, default=256, help="global batch size (samples per step)")
    parser.add_argument("--image-size", type=int, default=64, help="synthetic images are 3 x S x S")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--amp", choices=["no", "bf16"], default="no")
    parser.add_argument("--ids", default="all", help="devices.ids: 'all' or a comma list (none uses the first)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(run_child(args)), flush=True)
        return 0

    results = []
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", "--mode", mode, *_strip_option(passthrough, "--json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            results.append({"mode": mode, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    print(
        f"{'mode':<5} {'wrapped':<27} {'per-device batch':<18} {'samples/s':>10} {'ms/step':>8}  "
        "peak MiB per device  devices"
    )
    for res in results:
        if "error" in res:
            print(f"{res['mode']:<5} not run: {res['error']}")
            continue
        print(
            f"{res['mode']:<5} {res['wrapped']:<27} {res['per_device_batch']!s:<18} {res['samples_per_s']:>10.1f} "
            f"{res['ms_per_step']:>8.2f}  {res['peak_mib']!s:<20} {', '.join(res['devices'])}"
        )
        for note in res["notes"]:
            print(f"      note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if all("error" in r for r in results) else 0


def _strip_option(argv: list[str], name: str) -> list[str]:
    """Drop ``name VALUE`` / ``name=VALUE`` and ``--modes`` from a child's arguments."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in (name, "--modes"):
            skip = True
            continue
        if arg.startswith((name + "=", "--modes=")):
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
