"""What was asked: the spec schema and its rules, reading TOML and ``extends``, ``--set``, messages, dumping.

One module per step: ``schema`` (the root table and what is trained and recorded), ``schema_loop`` (``[optim]``,
``[scheduler]``, ``[early_stopping]``, ``[train]``), ``schema_parallel`` (``[devices]``, ``[parallel]``
and the mode table ``MODES``) and ``names`` (model and dataset names), on ``rules`` (the base of every table, the
wording rules share);
``reading`` (files -> dict, ``extends``, ``--set`` and ``--unset``, key origins), ``loading`` (validation into
located issues, which specs extend a file, ``runner validate``), ``messages`` (how problems are worded, key lines),
``dump`` (TOML, flat keys, hash, the keys that apply, run names) and ``editor_schema`` (the JSON Schema for editors,
``.taplo.toml``, the Markdown key reference). The package imports neither torch nor mlflow, so ``runner validate``
answers on any laptop.

A key's default is said once, in its ``Field(default=...)``: the reference's default column and the JSON Schema's
``default`` show it, and a description says ``Default:`` only for what an unset key means (tested). The root,
``ExperimentSpec``, comes after its tables, so its fields' types are resolved when the module is imported.
"""
