"""What was asked: the spec schema and its rules, reading TOML and ``extends``, ``--set``, messages, dumping.

One module per step: :mod:`~runner.spec.schema` (the root table and the loop's tables) with
:mod:`~runner.spec.schema_data`, :mod:`~runner.spec.schema_parallel`, :mod:`~runner.spec.schema_sweep`
and :mod:`~runner.spec.objectives` (the other tables) on the base :mod:`~runner.spec.table`, and
:mod:`~runner.spec.rules` (rules between keys); :mod:`~runner.spec.reading` (files -> dict and key
origins), :mod:`~runner.spec.overrides` (``--set``), :mod:`~runner.spec.loading` (validation into
located issues), :mod:`~runner.spec.messages` with :mod:`~runner.spec.wording` and
:mod:`~runner.spec.suggest` (how problems are worded), :mod:`~runner.spec.dump` (TOML, flat keys,
hash), :mod:`~runner.spec.locate` (key lines), :mod:`~runner.spec.dependents` (which specs extend
a file), :mod:`~runner.spec.validate` (``runner validate``), :mod:`~runner.spec.editor_schema` (the
JSON Schema for editors, ``.taplo.toml``) and :mod:`~runner.spec.reference` (Markdown reference).
Imports neither torch nor mlflow, so ``runner validate`` answers on any laptop.
"""
