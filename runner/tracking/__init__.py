"""Everything MLflow: the store and its URI, the run lifecycle, parent runs, provenance tags, trackers. No other
package of runner imports mlflow; the package map is in docs/design.md."""

import os

# MLflow prints "View run NAME at: URL" on ending a run of a server, with any credentials of the URL;
# runner prints its own masked line instead (docs/design.md §12).
os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
