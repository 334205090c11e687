"""Reading specs: extends, --set overrides, path resolution, dump/flatten/hash, and key location."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runner.errors import SpecError
from runner.spec.dump import dump_spec, flatten_spec
from runner.spec.loading import LoadedSpec, load_spec, spec_from_dict
from runner.spec.messages import format_key, locate_keys, nearest
from tests.helpers import SMALL, spec_text

ASSETS = Path(__file__).parents[1] / "assets"
MINIMAL = spec_text(SMALL, compact=True)


def write(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- loading


def test_minimal_spec_loads(tmp_path: Path):
    path = write(tmp_path, "# a comment\n" + MINIMAL)
    loaded = load_spec(os.path.relpath(path))  # relative to the cwd (tmp_path)
    assert isinstance(loaded, LoadedSpec)
    assert loaded.path == path and loaded.path.is_absolute()
    assert loaded.source_text == "# a comment\n" + MINIMAL
    assert loaded.data == tomllib.loads(MINIMAL)
    assert loaded.spec.data.batch_size == 8 and loaded.spec.parallel.mode == "none"
    assert len(loaded.sha256) == 64 and int(loaded.sha256, 16) >= 0


def test_int_literal_for_float_is_stored_as_float(tmp_path: Path):
    loaded = load_spec(write(tmp_path, MINIMAL.replace("lr = 0.1", "lr = 1")))
    assert loaded.spec.optim.lr == 1.0 and isinstance(loaded.spec.optim.lr, float)
    assert isinstance(flatten_spec(loaded.spec)["optim.lr"], float)
    assert "lr = 1.0" in dump_spec(loaded.spec)


def test_extends_merges_tables_and_replaces_values():
    loaded = load_spec(ASSETS / "loading_child.toml")
    spec = loaded.spec
    assert spec.name == "child"  # child wins
    assert spec.seed == 3  # from base
    assert spec.model.kwargs == {"hidden": [16, 16], "num_classes": 3}
    assert spec.data.dataset == "synthetic" and spec.data.batch_size == 8  # table merged key by key
    assert spec.data.input_shape == [4]  # list replaced
    assert (spec.optim.lr, spec.optim.momentum) == (0.05, 0.9)
    assert spec.devices.accelerator == "cpu"
    assert spec.train.epochs == 3  # the later base wins
    assert spec.data.root == str(ASSETS / "loading_bases" / "data")  # relative to the file that wrote it
    assert "extends" not in loaded.data
    assert loaded.source_text == (ASSETS / "loading_child.toml").read_text(encoding="utf-8")


def test_extends_error_points_at_the_file_that_wrote_the_key(tmp_path: Path):
    write(tmp_path, MINIMAL + "[train]\nepochs = 0\n", "base.toml")
    child = write(tmp_path, 'extends = "base.toml"\n\n[train]\nepochs = -1\n', "child.toml")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    assert [(i.file, i.line, i.key) for i in info.value.issues] == [(child, 4, "train.epochs")]


def test_diamond_extends_is_not_a_cycle(tmp_path: Path):
    write(tmp_path, MINIMAL, "root.toml")
    write(tmp_path, 'extends = "root.toml"\nseed = 1\n', "left.toml")
    write(tmp_path, 'extends = "root.toml"\ndeterministic = true\n', "right.toml")
    spec = load_spec(write(tmp_path, 'extends = ["left.toml", "right.toml"]\n', "top.toml")).spec
    assert (spec.seed, spec.deterministic) == (1, True)


def test_extends_must_name_files(tmp_path: Path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "extends = 3\n" + MINIMAL))
    (issue,) = info.value.issues
    assert (issue.line, issue.key) == (1, "extends") and "expected a file name" in issue.message


# ----------------------------------------------------------------------------- --set


def test_set_takes_precedence_over_file_and_extends():
    loaded = load_spec(
        ASSETS / "loading_child.toml",
        ["optim.lr=0.5", "train.epochs=1", "seed=7", 'name="quoted"', "data.input_shape=[2, 3]", "optim.lr=0.25"],
    )
    spec = loaded.spec
    assert spec.optim.lr == 0.25  # the last --set wins
    assert (spec.train.epochs, spec.seed, spec.name, spec.data.input_shape) == (1, 7, "quoted", [2, 3])
    assert loaded.data["optim"] == {"name": "sgd", "lr": 0.25, "momentum": 0.9}


def test_set_values_are_toml_and_bare_words_are_strings(tmp_path: Path):
    spec = load_spec(
        write(tmp_path, MINIMAL),
        [
            "parallel.mode=ddp",
            "devices.accelerator=cpu",
            "devices.ids=[0,1]",
            "parallel.nproc_per_node=2",
            "scheduler.name=cosine",
        ],
    ).spec
    assert spec.parallel.mode == "ddp" and spec.devices.ids == [0, 1] and spec.parallel.nproc_per_node == 2
    assert spec.scheduler is not None and spec.scheduler.name == "cosine"  # a missing table is created


def test_set_string_keys_keep_the_text(tmp_path: Path):
    spec = load_spec(write(tmp_path, MINIMAL), ["name=123", "tags.ticket=42", "description=a b c"]).spec
    assert (spec.name, spec.tags, spec.description) == ("123", {"ticket": "42"}, "a b c")


def test_set_replaces_a_whole_table(tmp_path: Path):
    path = write(tmp_path, MINIMAL.replace('name = "mlp"', 'name = "mlp"\nkwargs = { hidden = [4] }'))
    spec = load_spec(path, ["model.kwargs={ num_classes = 5 }"]).spec
    assert spec.model.kwargs == {"num_classes": 5}


# ----------------------------------------------------------------------------- paths


def test_relative_paths_resolve_against_the_spec_folder(tmp_path: Path):
    path = write(tmp_path, MINIMAL + '[checkpoint]\ndir = "../ckpt"\n', "sub/spec.toml")
    text = path.read_text().replace("batch_size = 8", 'batch_size = 8\nroot = "data/digits"')
    path.write_text(text)
    spec = load_spec(path).spec
    assert spec.data.root == str(tmp_path / "sub" / "data" / "digits")
    assert spec.checkpoint.dir == str(tmp_path / "ckpt")


def test_absolute_and_home_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(
        tmp_path,
        MINIMAL.replace("batch_size = 8", 'batch_size = 8\nroot = "~/data"')
        + f'[checkpoint]\ndir = "{tmp_path / "abs"}"\n',
    )
    spec = load_spec(path).spec
    assert spec.data.root == str(tmp_path / "home" / "data")
    assert spec.checkpoint.dir == str(tmp_path / "abs")


def test_set_paths_resolve_against_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = write(tmp_path, MINIMAL, "specs/spec.toml")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path, ["data.root=here"]).spec
    assert spec.data.root == str(tmp_path / "here")


# ----------------------------------------------------------------------------- dump, hash, flatten

VARIANTS = {
    "minimal": "",
    "ddp-cpu": '[devices]\naccelerator = "cpu"\n[parallel]\nmode = "ddp"\nnproc_per_node = 2\ntimeout_s = 60\n',
    "dp-cuda": '[devices]\naccelerator = "cuda"\nids = [0, 1]\n[parallel]\nmode = "dp"\noutput_device = 1\n',
    "adam-schedule": (
        '[scheduler]\nname = "step"\nkwargs = { step_size = 2, gamma = 0.5 }\n[train]\nclip_grad_norm = 1\n'
    ),
    "sweep": (
        '[sweep]\nmethod = "random"\ntrials = 3\n'
        '[sweep.params."optim.lr"]\nlow = 0.001\nhigh = 0.1\ndistribution = "log_uniform"\n'
    ),
    "kwargs-tags": '[tags]\nteam = "vision"\n[tracking]\nuri = "sqlite:///x.db"\n',
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dump_round_trips_to_an_equal_spec(tmp_path: Path, variant: str):
    text = MINIMAL + VARIANTS[variant]
    if variant == "adam-schedule":
        text = text.replace("lr = 0.1", 'name = "adam"\nlr = 0.1\nkwargs = { betas = [0.9, 0.99] }')
    loaded = load_spec(write(tmp_path, text))
    dumped = dump_spec(loaded.spec)
    assert spec_from_dict(tomllib.loads(dumped)) == loaded.spec
    again = load_spec(write(tmp_path, dumped, "dumped.toml"))
    assert again.spec == loaded.spec and again.sha256 == loaded.sha256


def test_dump_writes_defaults_but_not_options_of_other_modes(tmp_path: Path):
    dumped = tomllib.loads(dump_spec(load_spec(write(tmp_path, MINIMAL)).spec))
    assert dumped["train"]["epochs"] == 1 and dumped["data"]["val_fraction"] == 0.2
    assert dumped["parallel"] == {"mode": "none"}  # dp/ddp options would be rejected under mode = "none"
    assert "root" not in dumped["data"] and "scheduler" not in dumped  # None is left out


def test_sha256_ignores_comments_and_layout_but_not_values(tmp_path: Path):
    plain = load_spec(write(tmp_path, MINIMAL, "a.toml")).sha256
    styled = 'name="t" # run\n\n[optim]\n  lr = 0.100\n[data]\nbatch_size=8\ndataset="synthetic"\n[model]\nname="mlp"\n'
    assert load_spec(write(tmp_path, styled, "b.toml")).sha256 == plain
    assert load_spec(write(tmp_path, MINIMAL, "c.toml"), ["optim.lr=0.2"]).sha256 != plain


def test_flatten_spec(tmp_path: Path):
    text = MINIMAL.replace('name = "mlp"', 'name = "mlp"\nkwargs = { num_classes = 10, block = { width = 2 } }')
    flat = flatten_spec(load_spec(write(tmp_path, text)).spec)
    assert flat["name"] == "t"
    assert flat["model.kwargs.num_classes"] == 10
    assert flat["model.kwargs.block.width"] == 2
    assert flat["data.input_shape"] == [64]  # lists stay lists
    assert flat["optim.lr"] == 0.1 and isinstance(flat["train.epochs"], int)
    assert "data.root" not in flat and "scheduler.name" not in flat  # None omitted
    assert all(not isinstance(v, dict) for v in flat.values())


# ----------------------------------------------------------------------------- locate


def test_locate_keys_follows_toml_syntax():
    text = (
        'name = "x"  # comment with [fake] table\n'  # 1
        "a.b = 1\n"  # 2
        '"q.k" = 2\n'  # 3
        's = """\n'  # 4
        "[not_a_table]\n"  # 5
        'x = 1"""\n'  # 6
        "[model]\n"  # 7
        "kwargs = { depth = 2, inner = { w = 1 } }\n"  # 8
        "[devices]\n"  # 9
        "ids = [\n"  # 10
        "  0,\n"  # 11
        "  1,\n"  # 12
        "]\n"  # 13
        '[ sweep . params . "optim.lr" ]\n'  # 14
        "values = [0.1]\n"  # 15
        "[[runs]]\n"  # 16
        "n = 1\n"  # 17
        "[[runs]]\n"  # 18
        "n = 2\n"  # 19
    )
    tomllib.loads(text)
    lines = locate_keys(text)
    assert lines[("name",)] == 1
    assert lines[("a",)] == lines[("a", "b")] == 2
    assert lines[("q.k",)] == 3
    assert lines[("s",)] == 4 and ("not_a_table",) not in lines
    assert lines[("model",)] == 7 and lines[("model", "kwargs", "inner", "w")] == 8
    assert lines[("devices", "ids", 1)] == 12
    assert lines[("sweep", "params", "optim.lr", "values")] == 15
    assert lines[("runs", 1, "n")] == 19
    assert nearest(lines, ("model", "kwargs", "missing")) == 8  # nearest ancestor
    assert nearest(lines, ("devices", "accelerator")) == 9  # table header
    assert nearest(lines, ("train", "epochs")) is None  # nowhere: the callers say line 1


def test_locate_keys_reads_strings_numbers_and_nesting_as_toml_does():
    text = (
        'a = """x\n""""\n'  # 1-2: a multi-line string that ends in a quote
        "b = 'a # not a comment'\n"  # 3
        "c = [ [1.5, 2], [{ d = -inf }] ]\n"  # 4
        "e = 1979-05-27 07:32:00Z\n"  # 5
        '[ "x.y" . z ]\n'  # 6
        'w = "[not] = a table"\n'  # 7
    )
    tomllib.loads(text)
    lines = locate_keys(text)
    assert (lines[("b",)], lines[("c", 1, 0, "d")], lines[("e",)]) == (3, 4, 5)
    assert lines[("x.y", "z", "w")] == 7 and ("not",) not in lines


def test_format_key():
    assert format_key(("sweep", "params", "optim.lr", "values", 0)) == 'sweep.params."optim.lr".values[0]'


def test_loading_imports_neither_torch_nor_mlflow():
    code = (
        "import importlib, pkgutil, sys, runner.spec\n"
        "for m in pkgutil.iter_modules(runner.spec.__path__): importlib.import_module('runner.spec.' + m.name)\n"
        "assert 'runner.spec.reading' in sys.modules and 'runner.spec.dump' in sys.modules\n"
        "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_override_with_bare_fraction_says_write_0_point(tmp_path) -> None:
    from runner.errors import SpecError
    from runner.spec.loading import load_spec

    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(SMALL, compact=True))
    with pytest.raises(SpecError) as info:
        load_spec(spec, ["optim.lr=.001"])
    assert str(info.value) == "--set: optim.lr: invalid TOML value .001 (write 0.001)"


def test_override_creating_an_unknown_table_blames_the_override(tmp_path) -> None:
    from runner.errors import SpecError
    from runner.spec.loading import load_spec

    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(SMALL, compact=True))
    with pytest.raises(SpecError) as info:
        load_spec(spec, ["foo.bar.baz=1"])
    text = str(info.value)
    assert text.startswith("--set: foo:") and "from --set foo.bar.baz=1" in text


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node: parallel.nproc_per_node: got 0; expected a value >= 1 "),
        (["--node-rank", "-1"], "--node-rank: parallel.node_rank: got -1; expected a value >= 0 (from --node-rank -1)"),
        (["--rdzv-endpoint", "foo"], "(from --rdzv-endpoint foo)"),
        (["--nnodes", "2"], "parallel.nnodes: nnodes = 2 needs rdzv_endpoint"),  # a rule of the plan
    ],
)
def test_a_bad_shorthand_flag_is_named_as_typed(write_spec, capsys, flags: list, expected: str) -> None:
    from runner.cli import main

    assert main(["plan", str(write_spec()), "--set", "parallel.mode=ddp", *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err and f"(from {' '.join(flags)})" in err and "--set parallel." not in err, err


def test_a_shorthand_flag_is_a_plain_set_in_records_and_survives_pickling() -> None:
    import pickle

    from runner.spec.reading import FlagOverride, parallel_flags, typed_as

    (flag,) = parallel_flags(nproc_per_node=2)
    assert flag == "parallel.nproc_per_node=2" and typed_as(flag) == "--nproc-per-node 2"
    again = pickle.loads(pickle.dumps(flag))
    assert isinstance(again, FlagOverride) and (again, again.option, again.typed) == (flag, flag.option, flag.typed)
    assert typed_as("optim.lr=0.1") == "--set optim.lr=0.1"


@pytest.mark.parametrize("key", ["tracking.run_name", "tracking.experiment"])
def test_an_empty_optional_name_is_rejected_with_the_fix(write_spec, key: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(), [f'{key}=""'])
    (issue,) = info.value.issues
    assert issue.key == key
    assert issue.message.startswith('got ""; expected at least 1 character (remove the key for its default)')
