"""A callback, as README "Callbacks" describes it (used by experiments/custom_model.toml).

``ValidationCurves`` keeps the validation metrics after each evaluation, logs the gap between the training and
validation loss as a metric of its own, and at the end logs a figure of the curves (``figures/val_curves.png``)
and the first layer's weights as an image (``images/first_layer.png``).
"""

from __future__ import annotations

from matplotlib.figure import Figure  # no pyplot: no display or backend needed


class ValidationCurves:
    """Plot ``metrics`` (validation metrics, e.g. ``["val/loss", "val/accuracy"]``) over the steps."""

    def __init__(self, metrics: list[str]) -> None:
        self.metrics = metrics
        self.seen: list[tuple[int, dict[str, float]]] = []

    def on_validation_end(self, ctx, metrics: dict[str, float]) -> None:
        self.seen.append((ctx.step, {name: metrics[name] for name in self.metrics if name in metrics}))
        if "train/epoch_loss" in ctx.metrics and "val/loss" in metrics:
            ctx.log_metrics({"val/generalization_gap": metrics["val/loss"] - ctx.metrics["train/epoch_loss"]})

    def on_train_end(self, ctx) -> None:
        figure = Figure(figsize=(6, 3.5))
        axes = figure.add_subplot()
        for name in self.metrics:
            points = [(step, values[name]) for step, values in self.seen if name in values]
            axes.plot([step for step, _ in points], [value for _, value in points], marker="o", label=name)
        axes.set_xlabel("step")
        axes.legend()
        ctx.log_figure(figure, "val_curves")
        first = next(p for p in ctx.model.parameters() if p.dim() == 2).detach()
        first = first.to_local() if hasattr(first, "to_local") else first  # fsdp: this rank's shard, no collective
        scaled = (first - first.min()) / (first.max() - first.min() + 1e-12)
        ctx.log_image(scaled.float(), "first_layer")
