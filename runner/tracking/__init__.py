"""Everything MLflow: the store and its URI, the run lifecycle, provenance tags, trackers.

No other package of runner imports mlflow.
"""
