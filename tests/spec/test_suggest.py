"""One did-you-mean for every message: matching ignores case, names are quoted, dotted keys are bare."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.errors import SpecError, close_matches, did_you_mean, join_or, show, suggest, with_hint
from runner.spec.loading import load_spec
from tests.helpers import SMALL, spec_text

ASSETS = Path(__file__).parents[1] / "assets"


def test_exact_match_ignoring_case_comes_alone():
    assert close_matches("MNIST", ["torchvision.MNIST", "mnist", "emnist"], n=3) == ["mnist"]
    assert close_matches("Mode", ["mode", "dim"]) == ["mode"]


def test_close_matches_keep_the_real_spelling_and_the_limit():
    assert close_matches("mdoe", ["mode", "dim", "backend"]) == ["mode"]
    assert close_matches("SHUFLE", ["shuffle", "seed"]) == ["shuffle"]
    assert close_matches("xyz", ["mode", "dim"]) == []
    assert len(close_matches("build_modle", ["build_model", "build_models", "build_module", "other"], n=2)) == 2


def test_mapping_matches_keys_and_suggests_values():
    builders = {"resnet18": "torchvision.resnet18", "resnet50": "torchvision.resnet50"}
    assert close_matches("resnt18", builders) == ["torchvision.resnet18"]


def test_wording_is_the_same_for_one_and_many():
    assert did_you_mean("mdoe", ["mode"]) == 'did you mean "mode"?'
    assert did_you_mean("x", ["mode"]) == ""
    assert suggest(["a", "b", "c"]) == 'did you mean "a", "b" or "c"?'
    assert suggest(["optim.lr"], render=str) == "did you mean optim.lr?"
    assert suggest([]) == ""
    assert with_hint("unknown key", did_you_mean("mdoe", ["mode"])) == 'unknown key (did you mean "mode"?)'
    assert with_hint("unknown key", "") == "unknown key"
    assert join_or(["a"]) == "a" and join_or(["a", "b"]) == "a or b"


def test_show_writes_toml():
    assert [show(True), show("x"), show([1, "a"]), show({"a": 1}), show({}), show(float("inf"))] == [
        "true",
        '"x"',
        '[1, "a"]',
        "{ a = 1 }",
        "{}",
        "inf",
    ]
    assert show("y" * 100).endswith('..."'[:3]) and len(show("y" * 100)) == 60


def test_spec_messages_and_builders_word_it_alike(tmp_path: Path):
    from runner.training.models import check_model_name

    path = tmp_path / "s.toml"
    path.write_text(spec_text(SMALL, compact=True))
    with pytest.raises(SpecError) as spec_err:
        load_spec(path, ["parallel.mode=dpp"])
    with pytest.raises(SpecError) as model_err:
        check_model_name("mpl")
    assert '(did you mean "dp"?)' in str(spec_err.value)
    assert '(did you mean "mlp"?)' in str(model_err.value)


def test_no_other_module_matches_or_words_its_own_did_you_mean():
    root = Path(__file__).parents[2] / "runner"
    own = re.compile(r"difflib|get_close_matches|[\"'] ?\(?did you mean")
    offenders = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "errors.py" and own.search(p.read_text())
    ]
    assert offenders == []


def test_suggest_imports_nothing_heavy():
    code = "import sys, runner.errors; print(sorted(m for m in ('torch', 'mlflow', 'pydantic') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
