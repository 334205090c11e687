"""Everything MLflow: the store and its URI, the run lifecycle, parent runs, provenance tags, trackers.

No other package of runner imports mlflow. ``uri`` (which store, is it usable), ``runs``
(create, end, reopen, look up), ``tags`` (provenance), ``parents`` (runs that group child
runs), ``trackers`` and ``mlflow_tracker`` (what the loop logs through), ``models`` and
``system`` (model logging, system metrics), ``values`` (how values and keys are written).
"""
