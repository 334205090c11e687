"""The README's key reference is generated from the spec models and must not drift from them."""

from __future__ import annotations

from pathlib import Path

from runner.spec.editor_schema import BEGIN, END, markdown_reference
from runner.spec.schema import ExperimentSpec

README = Path(__file__).parents[2] / "README.md"


def test_readme_carries_the_current_reference() -> None:
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:stop] == markdown_reference(), "README is stale: paste `runner schema --markdown` into it"


def test_reference_lists_every_field_with_a_description() -> None:
    ref = markdown_reference()
    for name, field in ExperimentSpec.model_fields.items():
        assert f"`{name}`" in ref or f"**[{name}]**" in ref
        assert field.description, name
    assert "| `batch_size` | `int` | required |" in ref
    assert "| `mode` | " in ref and '`"none"`' in ref
