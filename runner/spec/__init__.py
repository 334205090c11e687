"""What was asked: the spec schema and its rules, reading TOML and ``extends``, ``--set``, messages, dumping. Details:
docs/design.md, "Module notes"."""
