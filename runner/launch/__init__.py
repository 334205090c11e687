"""How processes are made and who owns the run: the driver, the launchers, the worker entry."""
