"""Samples/s of one spec under none and DDP with 1 and 2 processes (``runner bench`` from Python).

Without a spec argument it benchmarks a built-in CPU spec: an MLP 784 -> 512 -> 512 -> 10 on
seeded synthetic data, global batch 256, gloo backend, recorded in a temporary sqlite store.
With a spec it measures that spec as ``runner bench SPEC --modes none,ddp`` would.

Usage::

    python benchmarks/ddp_throughput.py                          # built-in CPU spec, nproc 1,2
    python benchmarks/ddp_throughput.py experiments/digits_mlp.toml --nproc 1,2,4 --steps 50

Prints the ``runner bench`` table: samples/s, step time median / p90, data-wait share, peak
memory per process, scaling efficiency = samples/s / (n x samples/s of none) and the final
loss of each configuration (which must agree across modes for models without BatchNorm).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

BUILTIN = """
name = "ddp-throughput"
seed = 0

[model]
name = "mlp"
kwargs = {{ hidden = [512, 512] }}

[data]
dataset = "synthetic"
num_samples = 16384
input_shape = [784]
num_classes = 10
batch_size = 256
val_fraction = 0.0

[devices]
accelerator = "cpu"

[optim]
name = "sgd"
lr = 0.01
momentum = 0.9

[tracking]
uri = "sqlite:///{store}"
experiment = "ddp-throughput"
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", help="spec to measure (default: the built-in CPU MLP spec)")
    parser.add_argument("--nproc", default="1,2", help="ddp process counts (default 1,2)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per configuration (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument(
        "--out", default="bench-results", help="folder for bench.json / bench.png (default bench-results)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    args = parser.parse_args(argv)

    import json

    from runner.tools.bench import run_bench

    nprocs = [int(n) for n in args.nproc.split(",") if n.strip()]
    with tempfile.TemporaryDirectory(prefix="runner-ddp-throughput-") as tmp:
        spec = args.spec
        if spec is None:
            spec = str(Path(tmp) / "ddp_throughput.toml")
            Path(spec).write_text(BUILTIN.format(store=Path(tmp) / "mlflow.db"), encoding="utf-8")
        report = run_bench(
            spec, (), modes=["none", "ddp"], nprocs=nprocs, steps=args.steps, warmup=args.warmup, out_dir=args.out
        )
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
