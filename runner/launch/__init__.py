"""How processes are made and who owns the run: the driver, the launchers, the worker entry.

The process model (docs/design.md §6) lives here so that the packages below it need not know it: training
runs in whatever process this package made, and talks to the run through the tracker it was handed.
"""
