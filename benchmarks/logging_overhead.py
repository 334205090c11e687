"""Cost on the training thread of MLflow metric logging: synchronous MlflowClient vs buffered MlflowTracker.

Run: ``python benchmarks/logging_overhead.py [--calls 500] [--keys 1]``. Uses a sqlite store in a
temporary folder (deleted afterwards); prints microseconds per call and the ratio.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

from runner.tracking.runs import TrackedRun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="logging calls per variant (default 500)")
    parser.add_argument("--keys", type=int, default=1, help="metrics per call (default 1: MlflowClient.log_metric)")
    args = parser.parse_args()

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from runner.tracking.trackers import MlflowTracker

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # MLflow puts ./mlruns in the working directory
        uri = f"sqlite:///{tmp}/mlflow.db"
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment("bench")
        sync_run = client.create_run(exp).info.run_id
        buf_run = client.create_run(exp).info.run_id
        client.log_metric(sync_run, "warmup", 0.0, step=0)  # open the store before timing
        keys = [f"m{k}" for k in range(args.keys)]

        t0 = time.perf_counter()
        for step in range(args.calls):
            if len(keys) == 1:
                client.log_metric(sync_run, keys[0], float(step), step=step)
            else:  # the cheapest synchronous way to send several keys: one request per step
                ts = int(time.time() * 1000)
                client.log_batch(sync_run, metrics=[Metric(k, float(step), ts, step) for k in keys], synchronous=True)
        sync_s = time.perf_counter() - t0

        tracker = MlflowTracker(TrackedRun(uri, buf_run), flush_every_s=5.0)
        t0 = time.perf_counter()
        for step in range(args.calls):
            tracker.log_metrics({k: float(step) for k in keys}, step=step)
        buffered_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tracker.close()
        close_s = time.perf_counter() - t0
        assert len(client.get_metric_history(buf_run, keys[0])) == args.calls

        sync_us = sync_s / args.calls * 1e6
        buf_us = buffered_s / args.calls * 1e6
        print(f"{args.calls} calls x {args.keys} metrics, sqlite store")
        print(f"synchronous MlflowClient (log_metric/log_batch): {sync_us:10.1f} us/call")
        print(f"buffered MlflowTracker.log_metrics:              {buf_us:10.1f} us/call")
        print(f"ratio synchronous / buffered:                    {sync_us / buf_us:10.1f} x")
        print(f"final close() (sends everything, off the hot path until then): {close_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
