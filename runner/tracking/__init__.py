"""Everything MLflow: the store and its URI, the run lifecycle, parent runs, provenance tags, trackers.

No other package of runner imports mlflow. ``uri`` (which store, is it usable), ``runs``
(create, end, reopen, look up), ``tags`` (provenance), ``parents`` (runs that group child
runs), ``trackers`` and ``mlflow_tracker`` (what the loop logs through), ``models`` and
``system`` (model logging, system metrics), ``values`` (how values and keys are written).
"""

import os

# MLflow prints "View run NAME at: URL" on ending a run of a server, with any credentials of the URL;
# runner prints its own masked line instead (docs/design.md §12).
os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
