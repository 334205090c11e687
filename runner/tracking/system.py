"""MLflow system metrics (CPU, memory, GPU) recorded beside a run's training metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor


def start_system_metrics(uri: str | None, run_id: str, resumed: bool) -> SystemMetricsMonitor:
    """Start MLflow's system metrics monitor for ``run_id``; see ``mlflow.system_metrics``.

    Args:
        uri: Tracking URI of the run.
        run_id: The run.
        resumed: The run continues an earlier job: MLflow resumes the step numbering.

    Returns:
        The started ``SystemMetricsMonitor``; call ``finish()`` when training ends.
    """
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, tracking_uri=uri, resume_logging=resumed)
    monitor.start()
    return monitor
