"""The editor schema accepts every spec `runner validate` accepts, flags what JSON Schema can, and ships current.

check-jsonschema (and taplo, where installed) run once over every shipped spec, every spec in
tests/assets, the resolved dump of each shipped spec, and held-out bad specs; each file is its own
test id.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import main
from runner.errors import SpecError
from runner.spec.dump import dump_spec
from runner.spec.editor_schema import (
    BEGIN,
    END,
    GENERATED,
    SCHEMA_FILE,
    TAPLO_FILE,
    json_schema,
    markdown_reference,
    schema_text,
    taplo_config,
    write_editor_files,
)
from runner.spec.loading import load_spec

REPO = Path(__file__).parents[2]
ASSETS = Path(__file__).parents[1] / "assets"
SHIPPED = sorted((REPO / "experiments").glob("**/*.toml"))
HELD_OUT_BAD = sorted((ASSETS / "editor_bad").glob("*.toml"))
ASSET_SPECS = sorted(p for p in ASSETS.glob("**/*.toml") if p not in HELD_OUT_BAD)
# Bad specs that only `runner validate` can flag: JSON Schema has no arithmetic across keys and sees
# one file, not the files it extends.
SCHEMA_CANNOT_FLAG = {
    "ddp_batch_indivisible.toml": "batch_size % world size needs arithmetic across keys",
    "extends_cycle_a.toml": "the cycle is in the files extends names",
    "extends_cycle_b.toml": "the cycle is in the files extends names",
    "extends_missing.toml": "the missing base is another file",
    "infinite_lr.toml": "JSON has no inf or nan, so a schema cannot ask for a finite number",
    "nan_in_kwargs.toml": "JSON has no inf or nan, so a schema cannot ask for a finite number",
    "inf_in_sweep.toml": "JSON has no inf or nan, so a schema cannot ask for a finite number",
}
CHECK_JSONSCHEMA = Path(sys.executable).with_name("check-jsonschema")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _validate_accepts(path: Path) -> bool:
    try:
        load_spec(path)
    except SpecError:
        return False
    return True


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> list[Path]:
    """The resolved spec of every shipped spec (what `runner plan` prints and a run records), one file each."""
    folder = tmp_path_factory.mktemp("resolved")
    out = []
    for path in SHIPPED:
        target = folder / f"{path.stem}.resolved.toml"
        target.write_text(dump_spec(load_spec(path).spec), encoding="utf-8")
        out.append(target)
    return out


@pytest.fixture(scope="module")
def flagged(dumps) -> dict[str, list[str]]:
    """check-jsonschema over every file at once: file name -> its errors (absent: accepted)."""
    files = [*SHIPPED, *ASSET_SPECS, *HELD_OUT_BAD, *dumps]
    proc = subprocess.run(
        [str(CHECK_JSONSCHEMA), "-o", "json", "--schemafile", str(REPO / SCHEMA_FILE), *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(proc.stdout)
    out: dict[str, list[str]] = {}
    for item in report["errors"] + report["parse_errors"]:
        out.setdefault(str(Path(item["filename"]).resolve()), []).append(item["message"])
    assert (proc.returncode == 0) == (not out), proc.stderr
    return out


# ----------------------------------------------------------------------------- the shipped files are current


def test_shipped_schema_and_taplo_config_are_current() -> None:
    stale = "stale: run `runner schema --write` at the repository root and commit the result"
    assert (REPO / SCHEMA_FILE).read_text(encoding="utf-8") == schema_text(), stale
    assert (REPO / TAPLO_FILE).read_text(encoding="utf-8") == taplo_config(), stale


def test_write_regenerates_schema_taplo_and_readme_reference(tmp_path: Path, capsys) -> None:
    (tmp_path / "README.md").write_text(f"# x\n\n{BEGIN}\nold\n{END}\n\ntail\n", encoding="utf-8")
    assert main(["schema", "--write", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / SCHEMA_FILE}" in capsys.readouterr().out
    assert json.loads((tmp_path / SCHEMA_FILE).read_text()) == json_schema()
    assert (tmp_path / TAPLO_FILE).read_text() == taplo_config()
    readme = (tmp_path / "README.md").read_text()
    assert markdown_reference() in readme and readme.endswith("\n\ntail\n") and "\nold\n" not in readme


def test_write_leaves_a_taplo_config_of_the_users_alone(tmp_path: Path) -> None:
    mine = "[formatting]\nalign_entries = true\n"
    (tmp_path / TAPLO_FILE).write_text(mine, encoding="utf-8")
    written = write_editor_files(tmp_path)
    assert written == [tmp_path / SCHEMA_FILE]
    assert (tmp_path / TAPLO_FILE).read_text() == mine
    assert taplo_config().startswith(GENERATED)


def test_schema_maps_the_shipped_specs_with_a_path_relative_to_the_config() -> None:
    text = (REPO / TAPLO_FILE).read_text()
    assert 'include = ["experiments/**/*.toml"]' in text and f'path = "./{SCHEMA_FILE}"' in text
    readme = (REPO / "README.md").read_text()
    assert f"#:schema ../{SCHEMA_FILE}" in readme, "a spec in experiments/ reaches the schema one folder up"


# ----------------------------------------------------------------------------- the shape of the schema


def test_required_keys_apply_only_without_extends_and_every_table_is_closed() -> None:
    schema = json_schema()
    assert "required" not in schema and schema["if"] == {"not": {"required": ["extends"]}}
    assert schema["then"]["required"] == ["name", "model", "data", "optim"]
    assert schema["additionalProperties"] is False
    for name, definition in schema["$defs"].items():
        assert definition["additionalProperties"] is False, name
        if name.endswith("Partial"):
            assert "required" not in definition, name
    assert schema["$defs"]["DataSpec"]["required"] == ["dataset", "batch_size"]
    assert schema["properties"]["data"]["$ref"] == "#/$defs/DataSpecPartial"
    assert schema["then"]["properties"]["data"]["$ref"] == "#/$defs/DataSpec"
    assert '"type": "null"' not in json.dumps(schema), "TOML has no null"


def test_cli_prints_the_same_schema(capsys) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


# ----------------------------------------------------------------------------- check-jsonschema agrees with validate


@pytest.mark.parametrize("path", SHIPPED, ids=_rel)
def test_check_jsonschema_accepts_every_shipped_spec(path: Path, flagged) -> None:
    assert _validate_accepts(path)
    assert str(path.resolve()) not in flagged, flagged.get(str(path.resolve()))


def test_check_jsonschema_accepts_the_resolved_dump_of_every_shipped_spec(dumps, flagged) -> None:
    assert len(dumps) == len(SHIPPED) >= 6
    for path in dumps:
        assert _validate_accepts(path), path.name
        assert str(path.resolve()) not in flagged, (path.name, flagged.get(str(path.resolve())))


@pytest.mark.parametrize("path", ASSET_SPECS, ids=_rel)
def test_check_jsonschema_agrees_with_validate_on_the_test_specs(path: Path, flagged) -> None:
    rejected = str(path.resolve()) in flagged
    if _validate_accepts(path):
        assert not rejected, flagged[str(path.resolve())]
    elif path.name in SCHEMA_CANNOT_FLAG:
        assert not rejected, f"now flagged: drop {path.name} from SCHEMA_CANNOT_FLAG"
    else:
        assert rejected, f"runner validate rejects {path.name} but the schema accepts it"


@pytest.mark.parametrize("path", HELD_OUT_BAD, ids=_rel)
def test_check_jsonschema_rejects_held_out_bad_specs(path: Path, flagged) -> None:
    assert not _validate_accepts(path), "a held-out bad spec must be bad"
    assert str(path.resolve()) in flagged


def test_the_bad_specs_cover_both_branches() -> None:
    extending = [p for p in HELD_OUT_BAD if p.read_text().find("extends =") >= 0]
    assert len(extending) >= 3 and len(HELD_OUT_BAD) - len(extending) >= 6
    assert {p.name for p in (ASSETS / "bad").glob("*.toml")} >= set(SCHEMA_CANNOT_FLAG)


# ----------------------------------------------------------------------------- taplo, where installed


def _taplo() -> str | None:
    beside = Path(sys.executable).with_name("taplo")
    return str(beside) if beside.exists() else shutil.which("taplo")


@pytest.mark.skipif(_taplo() is None, reason="taplo is not installed (pip install '.[test]' brings it)")
def test_taplo_checks_the_shipped_specs_through_the_shipped_config(tmp_path: Path) -> None:
    taplo = _taplo()
    assert taplo is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RUST_LOG": "error"}
    good = subprocess.run(
        [taplo, "check", *(_rel(p) for p in SHIPPED)], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    assert good.returncode == 0, good.stderr
    project = tmp_path / "project"
    shutil.copytree(REPO / "experiments", project / "experiments")
    shutil.copy(REPO / SCHEMA_FILE, project)
    shutil.copy(REPO / TAPLO_FILE, project)
    (project / "experiments" / "typo.toml").write_text(
        'extends = "base/digits.toml"\nname = "typo"\n\n[parallel]\nmdoe = "ddp"\n', encoding="utf-8"
    )
    bad = subprocess.run(
        [taplo, "check", "experiments/typo.toml"], cwd=project, env=env, capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and "mdoe" in bad.stderr + bad.stdout


@pytest.mark.parametrize("target", ["missing/x.json", "/proc/x.json"])
def test_schema_to_an_unwritable_file_names_it_and_exits_2(tmp_path: Path, capsys, target: str) -> None:
    path = target if target.startswith("/") else str(tmp_path / target)
    assert main(["schema", "-o", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"runner: error: cannot write {path}: ") and "Traceback" not in err


def test_write_into_a_missing_folder_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["schema", "--write", str(tmp_path / "missing")]) == 2
    assert f"cannot write {tmp_path / 'missing' / SCHEMA_FILE}: No such file" in capsys.readouterr().err


def test_write_says_where_it_wrote_each_file_as_an_absolute_path(tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["schema", "--write"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"wrote {tmp_path / 'here' / SCHEMA_FILE}", f"wrote {tmp_path / 'here' / TAPLO_FILE}"]
