"""A test model factory, `probe_factory:build`: a small MLP that marks a point in training or crashes once there.

The environment steers it: PROBE_MARKER (a file to touch), PROBE_AT (from which training call), PROBE_CRASH (rank 1
exits hard once instead), PROBE_SLEEP (seconds rank 0 then takes per call, so a signal lands mid-run), PROBE_BUILD_SLEEP
(seconds the build takes: a window between a driver's start and its run's creation).
"""

import os
import time
from pathlib import Path

import torch


class Probe(torch.nn.Module):
    """A small MLP that can mark a point in training (for a test to signal) or crash once there."""

    def __init__(self, in_features: int = 8, num_classes: int = 3):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(in_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, num_classes)
        )
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            rank = int(os.environ.get("RANK", "0"))
            at = int(os.environ.get("PROBE_AT", "0"))
            marker = os.environ.get("PROBE_MARKER")
            if marker and self.calls >= at:
                if os.environ.get("PROBE_CRASH") and rank == 1 and not Path(marker).exists():
                    Path(marker).touch()
                    os._exit(3)  # a hard crash, once
                if not os.environ.get("PROBE_CRASH") and rank == 0:
                    Path(marker).touch()
                    time.sleep(float(os.environ.get("PROBE_SLEEP", "0.3")))  # so the signal lands mid-run
        return self.net(x)


def build(**kwargs):
    time.sleep(float(os.environ.get("PROBE_BUILD_SLEEP", "0")))
    return Probe(**kwargs)
