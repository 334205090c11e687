"""What was asked: the spec schema and its rules, reading TOML and ``extends``, ``--set``, messages, dumping.

One module per step: :mod:`~runner.spec.schema` (the root table, the loop's tables and ``[sweep]``) with
:mod:`~runner.spec.schema`, :mod:`~runner.spec.schema_parallel` and :mod:`~runner.spec.names`
(the other tables) on the base :mod:`~runner.spec.rules`, and :mod:`~runner.spec.rules` (rules between
keys); :mod:`~runner.spec.reading` (files -> dict, key origins, the folders a spec names),
:mod:`~runner.spec.overrides` (``--set``), :mod:`~runner.spec.loading` (validation into located issues,
which specs extend a file, ``runner validate``), :mod:`~runner.spec.messages` with
:mod:`~runner.errors` (how problems are worded, did-you-mean), :mod:`~runner.spec.dump` (TOML, flat
keys, hash, the keys that apply, run names), :mod:`~runner.spec.messages` (key lines) and
:mod:`~runner.spec.editor_schema` (the JSON Schema for editors, ``.taplo.toml``, the Markdown reference).
Imports neither torch nor mlflow, so ``runner validate`` answers on any laptop.
"""
