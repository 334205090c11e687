"""A model that does not fit the data's shapes is named by the data key that decides them, with the shapes seen."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli import main

pytestmark = pytest.mark.timeout(120)

MODELS = """
import torch
from torch import nn


class ThreeChannels(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


class WideFirstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(9216, 10)

    def forward(self, x):
        return self.fc(torch.flatten(x, 1))


class DoublesTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(x.view(-1, 32))
"""


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (
            "ThreeChannels",
            "data.num_channels: the model takes 3 channels but the batch has 1: set data.num_channels = 3",
        ),
        ("WideFirstLayer", "data.image_size: a layer takes 9216 features but gets 64: data.image_size and"),
        ("DoublesTheBatch", "model.name: the output has 32 rows for 16 targets: forward changed the batch dimension"),
    ],
)
def test_a_shape_error_names_the_data_key_and_the_shapes(
    write_spec, tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, says: str
) -> None:
    (tmp_path / "shaped.py").write_text(MODELS, encoding="utf-8")
    sets = ["--set", f'model={{name="shaped:{model}"}}', "--set", 'data={dataset="sklearn.digits", batch_size=16}']
    assert main(["exec", str(write_spec()), *sets]) == 1
    err = capsys.readouterr().err
    assert says in err and "the batch holds input [16, 1, 8, 8]" in err and "Traceback" not in err, err
    if model != "DoublesTheBatch":  # raised inside the user's forward: their file and line
        assert f"{tmp_path / 'shaped.py'}:" in err, err
