"""The README's key reference is generated from the spec models and must not drift from them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

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


def _tables(model: type[BaseModel] = ExperimentSpec) -> Iterator[type[BaseModel]]:
    yield model
    for field in model.model_fields.values():
        for inner in (field.annotation, *get_args(field.annotation)):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                yield from _tables(inner)


def test_a_description_leaves_a_plain_default_to_the_default_column() -> None:
    """The reference's default column (and the JSON Schema's ``default``) says a value default once; a description
    that says it again drifts when the default changes. ``Default:`` stays for what an unset key means."""
    restated = []
    for model in set(_tables()):
        for name, field in model.model_fields.items():
            default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
            if default is not None and default is not PydanticUndefined and "Default:" in (field.description or ""):
                restated.append(f"{model.__name__}.{name}")
    assert not restated


def test_markdown_in_a_fresh_process_names_every_table() -> None:
    """``runner schema --markdown`` as the first thing a process does: every table resolved (it once printed
    ``ForwardRef('ModelSpec')`` and no ``[model]`` table, as the spec's root came before its tables)."""
    out = subprocess.run(
        [sys.executable, "-m", "runner", "schema", "--markdown"], capture_output=True, text=True, check=True
    ).stdout
    assert "ForwardRef" not in out
    assert all(f"**[{table}]**" in out for table in ("model", "data", "sweep", "optim"))
