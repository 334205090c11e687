"""Every invalid spec is rejected with FILE:LINE, the dotted key and a fix; no traceback or pydantic text leaks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.errors import SpecError
from runner.spec.loading import load_spec
from runner.spec.reading import MAX_SPEC_BYTES
from tests.helpers import SMALL, spec_text

BAD = Path(__file__).parents[1] / "assets" / "bad"

# file in tests/assets/bad -> (line, dotted key, fragments the message must contain)
CASES: dict[str, tuple[int | None, str, tuple[str, ...]]] = {
    "syntax_float.toml": (8, "optim.lr", ("invalid TOML", "column 6", "write 0.001")),
    "bare_word.toml": (8, "parallel.mode", ("invalid TOML", 'write mode = "ddp"')),
    "unknown_top_key.toml": (2, "seeed", ('unknown key "seeed"', 'did you mean "seed"?')),
    "misplaced_key.toml": (2, "lr", ('unknown key "lr"', "did you mean optim.lr?")),
    "unknown_nested_key.toml": (8, "parallel.mdoe", ('unknown key "mdoe"', "[parallel]", 'did you mean "mode"?')),
    "wrong_type_deep.toml": (9, "data.input_shape[1]", ('got "32"', "expected a whole number", "remove the quotes")),
    "quoted_number.toml": (8, "optim.lr", ('got "0.1"', "expected a number", "write 0.1")),
    "batch_size_zero.toml": (6, "data.batch_size", ("got 0", "expected a value >= 1")),
    "negative_lr.toml": (9, "optim.lr", ("got -0.1", "expected a value > 0")),
    "infinite_lr.toml": (9, "optim.lr", ("got inf", "expected a finite number")),
    "nan_in_kwargs.toml": (10, "optim.kwargs.eps", ("got nan", "expected finite numbers")),
    "inf_in_sweep.toml": (10, 'sweep.params."optim.lr".values', ("[0.1, -inf]", "holds inf or nan")),
    "mode_typo.toml": (8, "parallel.mode", ('got "dpp"', '"none", "dp", "ddp" or "fsdp"', 'did you mean "dp"?')),
    # a value that fits no member of a union: one message naming every member, in TOML's words
    "ids_word.toml": (9, "devices.ids", ('got "al"; expected a list or "all"', 'did you mean "all"?')),
    "metric_number.toml": (10, "metrics.train[1]", ("got 3; expected a string or a table",)),
    "ddp_batch_indivisible.toml": (6, "data.batch_size", ("batch_size = 10", "world size 4")),
    "nccl_on_cpu.toml": (11, "parallel.backend", ("nccl", "cpu", "gloo")),
    "sync_batchnorm_cpu.toml": (11, "parallel.sync_batchnorm", ("sync_batchnorm needs CUDA",)),
    "duplicate_ids.toml": (9, "devices.ids", ("[1] more than once",)),
    "negative_ids.toml": (9, "devices.ids", ("negative", "[-1]")),
    "fractional_count.toml": (10, "train.epochs", ("got 2.5", "expected a whole number", "counts are whole numbers")),
    "int_for_bool.toml": (7, "data.shuffle", ("got 1", "expected true or false", "write true/false")),
    "missing_required.toml": (7, "optim.lr", ("required key is missing", "add lr = ... under [optim]")),
    "extends_missing.toml": (2, "extends", ('"no_such_base.toml"', "does not exist")),
    # a cycle is reported where it closes: in the file that extends the first one again
    "extends_cycle_a.toml": (2, "extends", ("extends cycle", "extends_cycle_a.toml -> ", "extends_cycle_b.toml -> ")),
    "extends_cycle_b.toml": (1, "extends", ("extends cycle", "extends_cycle_b.toml -> ", "extends_cycle_a.toml -> ")),
    "empty.toml": (None, "", ("spec is empty", "name", "model.name", "data.dataset", "data.batch_size", "optim.lr")),
}
REPORTED_IN = {"extends_cycle_a.toml": "extends_cycle_b.toml", "extends_cycle_b.toml": "extends_cycle_a.toml"}


def _error(path: Path, overrides: tuple[str, ...] = ()) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return info.value


def _assert_clean(text: str) -> None:
    for leak in ("pydantic", "Traceback", "https://", "Input should be", "Value error,"):
        assert leak not in text, f"{leak!r} leaked into: {text}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_spec_is_located_and_explained(name: str):
    line, key, fragments = CASES[name]
    error = _error(BAD / name)
    path = BAD / REPORTED_IN.get(name, name)
    text = str(error)
    assert len(error.issues) == 1, text
    issue = error.issues[0]
    assert issue.file == path
    assert issue.key == key
    assert issue.line == line
    assert text.startswith(f"{path}:{line}: {key}: " if line else f"{path}: ")
    for fragment in fragments:
        assert fragment in text
    _assert_clean(text)


def test_every_bad_asset_has_a_case():
    assert sorted(p.name for p in BAD.glob("*.toml")) == sorted([*CASES, "several_errors.toml"])


def test_several_errors_are_reported_together():
    path = BAD / "several_errors.toml"
    error = _error(path)
    found = [(i.line, i.key) for i in error.issues]
    assert found == [
        (6, "data.batch_size"),
        (7, "data.shufle"),
        (9, "parallel.mode"),
        (11, "optim.lr"),
        (13, "train.epochs"),
    ]
    text = str(error)
    assert 'did you mean "shuffle"?' in text and 'did you mean "dp"?' in text
    assert all(line.startswith(f"{path}:") for line in text.splitlines())
    _assert_clean(text)


def test_not_utf8_names_line_and_byte(tmp_path: Path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'name = "t"\n[model]\nname = "caf\xe9"\n')
    error = _error(path)
    (issue,) = error.issues
    assert (issue.file, issue.line) == (path, 3)
    assert "not UTF-8" in issue.message and "0xe9" in issue.message and "byte offset 30" in issue.message


def test_directory_is_rejected(tmp_path: Path):
    error = _error(tmp_path)
    assert str(error) == f"{tmp_path}: is a directory, not a spec file: give the path of a .toml file"


@pytest.mark.parametrize(
    ("target", "kind"),
    [("/dev/zero", "a character device"), ("/dev/urandom", "a character device"), ("fifo", "a FIFO")],
)
def test_a_spec_path_that_is_no_regular_file_is_refused_unread(tmp_path: Path, target: str, kind: str):
    # A link to /dev/zero was read until the OOM killer came (18.7 GB); /dev/urandom read on; a FIFO blocked forever.
    if target == "fifo":
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    path = tmp_path / "spec.toml"
    path.symlink_to(target)
    assert str(_error(path)) == f"{path}: is {kind}, not a spec file: give the path of a .toml file"


def test_a_spec_file_past_the_size_bound_is_refused(tmp_path: Path):
    path = tmp_path / "huge.toml"
    path.write_bytes(b"# " + b"x" * MAX_SPEC_BYTES + b"\n")
    assert str(_error(path)) == f"{path}: is larger than 4 MiB, too large for a spec: give the path of a .toml file"


def test_missing_path_is_rejected(tmp_path: Path):
    path = tmp_path / "nope.toml"
    error = _error(path)
    assert str(error).startswith(f"{path}: spec file not found")


def test_comment_only_file_is_empty(tmp_path: Path):
    path = tmp_path / "comments.toml"
    path.write_text("# nothing here yet\n\n", encoding="utf-8")
    assert "spec is empty" in str(_error(path))


def test_error_in_base_file_points_at_base(tmp_path: Path):
    (tmp_path / "base.toml").write_text('[model]\nname = "mlp"\n[train]\n\nepochs = 0\n', encoding="utf-8")
    child = tmp_path / "child.toml"
    child.write_text(
        'extends = "base.toml"\nname = "c"\n[data]\ndataset = "synthetic"\nbatch_size = 8\n[optim]\nlr = 0.1\n',
        encoding="utf-8",
    )
    (issue,) = _error(child).issues
    assert (issue.file, issue.line, issue.key) == (tmp_path / "base.toml", 5, "train.epochs")


def test_syntax_error_in_base_names_base(tmp_path: Path):
    (tmp_path / "base.toml").write_text("[optim]\nlr = 1.\n", encoding="utf-8")
    child = tmp_path / "child.toml"
    child.write_text('extends = ["base.toml"]\nname = "c"\n', encoding="utf-8")
    (issue,) = _error(child).issues
    assert (issue.file, issue.line, issue.key) == (tmp_path / "base.toml", 2, "optim.lr")
    assert "write 1.0" in issue.message


MINIMAL = spec_text(SMALL, compact=True)


@pytest.fixture
def minimal(tmp_path: Path) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(MINIMAL, encoding="utf-8")
    return path


def test_set_unknown_key_says_it_came_from_set(minimal: Path):
    error = _error(minimal, ("parallel.mdoe=ddp",))
    (issue,) = error.issues
    assert (issue.file, issue.line, issue.key) == (None, None, "parallel.mdoe")
    assert 'did you mean "mode"?' in issue.message
    assert "(from --set parallel.mdoe=ddp)" in issue.message
    assert str(error).startswith("--set: parallel.mdoe: ")


def test_set_wrong_type(minimal: Path):
    (issue,) = _error(minimal, ("data.batch_size=abc",)).issues
    assert (issue.file, issue.key) == (None, "data.batch_size")
    assert 'got "abc"; expected a whole number' in issue.message
    assert "from --set data.batch_size=abc" in issue.message


@pytest.mark.parametrize("override", ["optim.lr", "=0.1", "optim lr=0.1", "a\nb=0.1"])
def test_set_that_is_not_key_value(minimal: Path, override: str):
    (issue,) = _error(minimal, (override,)).issues
    assert issue.file is None and "expected dotted.key=value" in issue.message


def test_set_below_a_scalar(minimal: Path):
    (issue,) = _error(minimal, ("name.first=x",)).issues
    assert issue.key == "name.first" and 'name is "t", not a table' in issue.message


def test_set_errors_and_file_errors_come_together(tmp_path: Path):
    path = tmp_path / "spec.toml"
    path.write_text(MINIMAL.replace("batch_size = 8", "batch_size = 0"), encoding="utf-8")
    error = _error(path, ("optim.lr=-1",))
    assert [(i.file, i.line, i.key) for i in error.issues] == [(path, 6, "data.batch_size"), (None, None, "optim.lr")]


def test_spec_from_dict_reports_keys():
    from runner.spec.loading import spec_from_dict

    with pytest.raises(SpecError) as info:
        spec_from_dict(
            {"name": "t", "model": {"name": "mlp"}, "data": {"dataset": "s"}, "optim": {"lr": 0.1}}, origin="sweep"
        )
    (issue,) = info.value.issues
    assert issue.key == "data.batch_size" and str(info.value).startswith(
        "sweep: data.batch_size: required key is missing"
    )


DEEP = {
    "arrays": "[" * 2000 + "]" * 2000,
    "tables": "{a = " * 2000 + "1" + "}" * 2000,
    "both": "[{a = " * 999 + "1" + "}]" * 999,
}


@pytest.mark.parametrize("kind", sorted(DEEP))
def test_deep_nesting_is_refused_at_its_line_before_the_parser_recurses(tmp_path: Path, kind: str):
    path = tmp_path / "deep.toml"
    brackets = "[" * 40  # in a string and a comment: not nesting
    value = f'description = "{brackets}"  # {brackets}\n[model]\nkwargs.x = {DEEP[kind]}'
    text = spec_text(SMALL, name="deep").replace("[model]", value, 1)
    path.write_text(text, encoding="utf-8")
    (issue,) = _error(path).issues
    line = text.splitlines().index(f"kwargs.x = {DEEP[kind]}") + 1
    assert (issue.line, issue.key) == (line, "model.kwargs.x"), issue
    assert "nest more than 32 levels" in issue.message
    _assert_clean(str(issue))


@pytest.mark.parametrize(
    ("text", "line", "fix"),
    [
        ('name = "x"\n[model]\nname = "mlp\n', 3, 'close the string with " on the same line'),
        ('name = "x"\n[model\nname = "mlp"\n', 2, "close the table name with ]: [model]"),
    ],
)
def test_a_toml_slip_gets_its_fix(tmp_path: Path, text: str, line: int, fix: str) -> None:
    path = tmp_path / "slip.toml"
    path.write_text(text, encoding="utf-8")
    (issue,) = _error(path).issues
    assert issue.line == line and "invalid TOML" in issue.message and fix in issue.message, issue
