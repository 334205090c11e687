"""Model and dataset names checked when a spec file is validated, without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.errors import SpecError
from runner.spec import names
from runner.spec.loading import load_spec, spec_from_dict
from tests.helpers import SMALL

REPO = Path(__file__).parents[2]
ASSETS = REPO / "tests" / "assets"
TYPOS = 'name = "typos"\n\n[model]\nname = "mpl"\n\n[data]\ndataset = "sklearn.digts"\nbatch_size = 0\n\n[optim]\nlr = 0.1\n'


def _spec(tmp_path: Path, model: str, dataset: str = "synthetic") -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(
        f'name = "n"\n[model]\nname = "{model}"\n[data]\ndataset = "{dataset}"\nbatch_size = 8\n[optim]\nlr = 0.1\n'
    )
    return path


def test_the_generated_list_is_the_installed_torchvisions() -> None:
    """After installing another torchvision, regenerate it: ``python -m runner.training.models``."""
    from importlib.metadata import version

    from runner.training.models import installed_torchvision_names

    assert names.torchvision_names() == installed_torchvision_names()
    generated = names.generated()
    assert version("torchvision").partition("+")[0] == generated["version"]
    assert "resnet18" in generated["models"] and "MNIST" in generated["datasets"]
    assert not names.NOT_DATASETS & set(generated["datasets"])


def test_the_generator_writes_what_is_committed(tmp_path: Path) -> None:
    from runner.training.models import write_torchvision_names

    written = write_torchvision_names(tmp_path / "names.json")
    assert written.read_text() == names.GENERATED.read_text()


def test_validate_reports_both_misspelled_names_with_lines_and_without_torch(tmp_path: Path) -> None:
    spec = tmp_path / "typos.toml"
    spec.write_text(TYPOS)
    code = (
        "import json, sys; from runner.cli import main; rc = main(['validate', sys.argv[1]]); "
        "print(json.dumps(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []
    assert f"{spec}:4: model.name: unknown model 'mpl' (did you mean \"mlp\"?)" in proc.stderr
    assert f"{spec}:7: data.dataset: unknown dataset 'sklearn.digts' (did you mean \"sklearn.digits\"" in proc.stderr
    assert f"{spec}:8: data.batch_size" in proc.stderr  # every problem of the file at once


@pytest.mark.parametrize(
    ("model", "dataset"),
    [
        ("mlp", "sklearn.digits"),
        ("torchvision.resnet18", "torchvision.MNIST"),
        ("torchvision.models.vit_b_16", "torchvision.CIFAR10"),
        ("factories:build_model", "factories:build_dataset"),  # beside the spec
        ("json:loads", "os.path:join"),  # installed modules, a submodule too
    ],
)
def test_known_names_pass(tmp_path: Path, model: str, dataset: str) -> None:
    path = _spec(tmp_path, model, dataset)
    (tmp_path / "factories.py").write_text((ASSETS / "factories.py").read_text())
    if dataset.startswith("torchvision."):
        path.write_text(path.read_text().replace("batch_size = 8", 'batch_size = 8\nroot = "data"'))
    assert load_spec(path).spec.model.name == model


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("torchvision.resnet_18", 'did you mean "torchvision.resnet18"'),
        ("resnet18", 'did you mean "torchvision.resnet18"'),
        ("factorys:build_model", "cannot import module 'factorys' of 'factorys:build_model': not found in the spec"),
        ("factorys:build_model", '(did you mean "factories"?)'),
        ("json.nosuch:f", "cannot import module 'json.nosuch'"),
        ("not an import:path", "is not an import path"),
    ],
)
def test_unknown_model_names_are_located_with_a_did_you_mean(tmp_path: Path, model: str, expected: str) -> None:
    (tmp_path / "factories.py").write_text("import torch\n")
    path = _spec(tmp_path, model)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    (issue,) = err.value.issues
    assert (issue.line, issue.key) == (3, "model.name") and expected in issue.message


def test_a_misspelled_torchvision_dataset_gets_the_class_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match='did you mean "torchvision.MNIST"'):
        load_spec(_spec(tmp_path, "mlp", "torchvision.mnsit"))


def test_a_factory_module_is_found_without_being_imported(tmp_path: Path) -> None:
    (tmp_path / "sideeffect.py").write_text("raise SystemExit('imported')\n")
    assert load_spec(_spec(tmp_path, "sideeffect:build")).spec.model.name == "sideeffect:build"
    assert "sideeffect" not in sys.modules


def test_names_the_list_lacks_are_left_to_exec_under_another_torchvision(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    empty = {**names.generated(), "models": []}
    monkeypatch.setattr(names, "generated", lambda: empty)
    with pytest.raises(SpecError, match="unknown model"):
        load_spec(_spec(tmp_path, "torchvision.resnet18"))
    monkeypatch.setattr(names, "generated", lambda: {**empty, "version": "0.0.1"})
    assert load_spec(_spec(tmp_path, "torchvision.resnet18")).spec.model.name == "torchvision.resnet18"


def test_a_spec_without_a_file_has_its_names_checked_when_built() -> None:
    assert spec_from_dict({**SMALL, "model": {"name": "mpl"}}).model.name == "mpl"
