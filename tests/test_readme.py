"""README examples of command output are the real output (paths aside), so a change of wording shows up here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.cli import main
from tests.helpers import readme_example

REPO = Path(__file__).parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_plan_example_is_the_real_plan(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(REPO)
    spec = "experiments/digits_mlp_ddp.toml"
    assert main(["plan", spec, "--set", "parallel.mode=none"]) == 0
    out = capsys.readouterr().out.replace(str(REPO), "/home/me/runner")
    assert out.splitlines() == readme_example(f"runner plan {spec} --set parallel.mode=none")


def test_the_bad_input_example_is_the_real_message(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    example = readme_example("runner validate bad.toml")
    lines = {int(m.group(1)): m.group(2) for m in (re.match(r"  bad\.toml:(\d+): (\S+):", x) for x in example) if m}
    assert lines == {6: "data.batch_size", 8: "parallel.mdoe"}
    text = ['name = "bad"', "[model]", 'name = "mlp"', "[data]", 'dataset = "sklearn.digits"', "batch_size = 0"]
    (tmp_path / "bad.toml").write_text("\n".join([*text, "[parallel]", 'mdoe = "ddp"', "[optim]", "lr = 0.1", ""]))
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "bad.toml"]) == 2
    captured = capsys.readouterr()
    assert [*captured.out.splitlines(), *captured.err.splitlines()] == example


def test_the_names_example_is_the_real_message(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    text = ['name = "typos"', "", "[model]", 'name = "mpl"', "", "[data]", 'dataset = "sklearn.digts"']
    (tmp_path / "typos.toml").write_text("\n".join([*text, "batch_size = 8", "", "[optim]", "lr = 0.1", ""]))
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "typos.toml"]) == 2
    captured = capsys.readouterr()
    assert [*captured.out.splitlines(), *captured.err.splitlines()] == readme_example("runner validate typos.toml")


def test_a_cpu_only_user_sees_the_cpu_install_before_any_command_and_the_test_command_is_unchanged() -> None:
    """README's first commands: the CPU-only install written out (one copyable line), before anything runs."""
    cpu = "python3 -m venv .venv && .venv/bin/pip install torch torchvision --index-url <PyTorch's CPU wheel index>"
    lines = README.splitlines()
    first_command = next(i for i, x in enumerate(lines) if x.startswith("python3 -m venv"))
    assert lines[first_command] == cpu
    assert "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/runner exec" in README  # the GPU install
    test_command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q"
    assert [x for x in lines if x.startswith("python3 -m venv")][2] == test_command  # README's second command


def test_every_ui_link_in_readme_and_docs_opens_the_training_view() -> None:
    """MLflow 3.17's UI opens the GenAI view unless the link asks for the training view (issue: UI links)."""
    import re

    texts = [README, *(p.read_text() for p in (REPO / "docs").glob("*.md"))]
    links = [m for text in texts for m in re.findall(r"#/experiments/(?:<[^>]*>|[^\s<>`)])*", text)]
    assert len(links) >= 2, links
    assert [link for link in links if not link.endswith("?workflowType=machine_learning")] == []
    assert "mlflow.experimentKind = custom_model_development" in README
    assert "http://127.0.0.1:5000/#/experiments/<id>/runs/<run_id>?workflowType=machine_learning" in README
    assert "<experiment>/bench" in README
