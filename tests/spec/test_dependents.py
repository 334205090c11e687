"""Which specs extend which: the chains `runner validate --dependents-in` follows when a base changes."""

from __future__ import annotations

from pathlib import Path

from runner.cli import main
from runner.spec.loading import extends_chain, plan_validation

FULL = (
    'name = "{name}"\n\n[model]\nname = "mlp"\n\n[data]\ndataset = "synthetic"\nbatch_size = 8\n\n[optim]\nlr = 0.1\n'
)


def _tree(root: Path) -> dict[str, Path]:
    files = {
        "base/common.toml": '[devices]\naccelerator = "cpu"\n',  # a fragment: not a spec on its own
        "base/full.toml": 'extends = "common.toml"\n' + FULL.format(name="full"),
        "a.toml": 'extends = "base/full.toml"\nname = "a"\n',
        "b.toml": 'extends = ["base/common.toml", "other.toml"]\nname = "b"\n',
        "other.toml": FULL.format(name="other"),
        "loop1.toml": 'extends = "loop2.toml"\n',
        "loop2.toml": 'extends = "loop1.toml"\n',
        "broken.toml": "extends = [\n",
        "pyproject.toml": '[project]\nname = "x"\n',
    }
    out = {}
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        out[name] = path
    return out


def test_extends_chain_is_transitive_and_survives_cycles_and_bad_files(tmp_path: Path) -> None:
    f = _tree(tmp_path)
    real = {k: v.resolve() for k, v in f.items()}
    assert extends_chain(f["a.toml"]) == {real["base/full.toml"], real["base/common.toml"]}
    assert extends_chain(f["b.toml"]) == {real["base/common.toml"], real["other.toml"]}
    assert extends_chain(f["loop1.toml"]) == {real["loop1.toml"], real["loop2.toml"]}
    assert extends_chain(f["broken.toml"]) == set() == extends_chain(f["pyproject.toml"])


def test_a_changed_base_is_checked_through_every_spec_that_extends_it(tmp_path: Path) -> None:
    f = _tree(tmp_path)
    plan = plan_validation([f["base/common.toml"]], [tmp_path])
    assert plan.bases == {f["base/common.toml"]: [f["a.toml"], f["b.toml"], f["base/full.toml"]]}
    assert plan.files == [f["a.toml"], f["b.toml"], f["base/full.toml"]]
    leaf = plan_validation([f["a.toml"], f["other.toml"]], [tmp_path])
    assert leaf.files == [f["a.toml"], f["b.toml"]] and list(leaf.bases) == [f["other.toml"]]
    assert plan_validation([f["a.toml"]], [tmp_path / "nowhere"]).files == [f["a.toml"]]


def test_validate_with_dependents_reports_the_spec_a_base_broke(tmp_path: Path, capsys) -> None:
    f = _tree(tmp_path)
    assert main(["validate", "--dependents-in", str(tmp_path), str(f["base/common.toml"])]) == 0
    out = capsys.readouterr().out
    assert f"base  {f['base/common.toml']}: checked through 3 spec(s) that extend it" in out
    assert f"ok    {f['a.toml']}" in out and f"ok    {f['b.toml']}" in out
    f["base/common.toml"].write_text('[devices]\naccelerator = "cpu"\n\n[parallel]\nmode = "dp"\n', encoding="utf-8")
    assert main(["validate", "--dependents-in", str(tmp_path), str(f["base/common.toml"])]) == 2
    captured = capsys.readouterr()
    assert f"error {f['a.toml']}" in captured.out and "parallel.mode" in captured.err
