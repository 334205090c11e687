"""What was asked: the spec schema, reading TOML and ``extends``, ``--set`` overrides, validation messages.

Imports neither torch nor mlflow, so ``runner validate`` answers on any laptop.
"""
