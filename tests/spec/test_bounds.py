"""Seeds and tensor sizes are bounded by what torch and NumPy take as C integers: the range is in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli import main
from runner.errors import SpecError
from runner.spec.loading import load_spec
from tests.helpers import MINIMAL, write_spec_file

HUGE = 99999999999999999999  # over 2**64: torch raises "Overflow when unpacking long long"


def _line_of(text: str, key: str) -> int:
    """1-based line of dotted ``key`` (list index dropped) in a file written by ``write_spec_file``."""
    *tables, leaf = key.split("[", maxsplit=1)[0].split(".")
    table = f"[{tables[0]}]" if tables else None
    inside = table is None
    for number, line in enumerate(text.splitlines(), 1):
        inside = inside or line == table
        if inside and line.startswith(f"{leaf} = "):
            return number
    raise AssertionError(f"{key} not in {text}")


@pytest.mark.parametrize(
    ("changes", "key", "expected"),
    [
        ({"seed": HUGE}, "seed", "expected a value >= 0 and < 9223372036854775808 (2**63)"),
        ({"seed": 2**63}, "seed", "< 9223372036854775808 (2**63)"),
        ({"seed": -1}, "seed", "expected a value >= 0 and < 9223372036854775808 (2**63)"),
        ({"data": {"split_seed": HUGE}}, "data.split_seed", "expected a value >= 0 and < 9223372036854775808"),
        ({"data": {"num_samples": 2**63}}, "data.num_samples", "expected a value >= 1 and < 9223372036854775808"),
        ({"data": {"input_shape": [2, HUGE]}}, "data.input_shape[1]", "expected a value < 9223372036854775808"),
        ({"sweep": {"seed": 2**32}}, "sweep.seed", "expected a value >= 0 and < 4294967296 (2**32)"),
    ],
)
def test_out_of_range_integers_are_located_with_their_range(
    tmp_path: Path, changes: dict, key: str, expected: str
) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, **changes)
    line = _line_of(path.read_text(), key)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}:{line}: {key}: got "), str(info.value)
    assert expected in str(info.value)


def test_largest_seeds_are_accepted(tmp_path: Path) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, seed=2**63 - 1, sweep={"seed": 2**32 - 1})
    spec = load_spec(path, ["data.split_seed=9223372036854775807"]).spec
    assert (spec.seed, spec.data.split_seed, spec.sweep and spec.sweep.seed) == (2**63 - 1, 2**63 - 1, 2**32 - 1)


@pytest.mark.parametrize("command", ["validate", "plan", "exec"])
@pytest.mark.parametrize("key", ["seed", "data.split_seed"])
def test_a_huge_seed_exits_2_before_any_run(tmp_path: Path, capsys, command: str, key: str) -> None:
    path = write_spec_file(tmp_path / "s.toml", MINIMAL, **({"seed": HUGE} if key == "seed" else {}))
    if key == "data.split_seed":
        path.write_text(path.read_text().replace("[data]\n", f"[data]\nsplit_seed = {HUGE}\n"))
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{key}: got {HUGE}; expected a value >= 0 and < 9223372036854775808 (2**63)" in err
    assert "Traceback" not in err and "Overflow" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # no store, no checkpoint


def test_a_huge_seed_on_the_command_line_exits_2(tmp_path: Path, capsys) -> None:
    path = write_spec_file(tmp_path / "s.toml")
    assert main(["exec", str(path), "--set", f"seed={HUGE}"]) == 2
    assert f"seed: got {HUGE}; expected a value >= 0 and < 9223372036854775808 (2**63)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]
