"""Tools built on the core: ``runner sweep``, ``runner bench`` and ``runner parity``. Nothing in the core imports them:
they run experiments through the same ``exec_experiment`` and plan a user runs, so what they measure is what a run
does."""
