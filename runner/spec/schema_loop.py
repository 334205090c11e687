"""Pydantic models of how training proceeds: the optimizer and its parameter groups, the learning-rate schedule,
early stopping and the loop. The root table (:mod:`runner.spec.schema`) holds them; they are apart so that each
file reads as one part of a spec."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from runner.spec import names
from runner.spec.rules import INT64_LIMIT, SpecTable, takes_momentum


def without(problem: str | None, value: str) -> str:
    """``value`` when a check found no ``problem`` with it; else ValueError (pydantic locates it at the key)."""
    if problem is not None:
        raise ValueError(problem)
    return value


class ParamGroupSpec(SpecTable):
    """``[[optim.groups]]``: the parameters whose names ``match`` a regular expression, with options of their own
    (torch's parameter groups): no weight decay on biases and norms, a lower lr for a backbone."""

    match: str = Field(min_length=1)
    """Regular expression searched in each parameter name (named_parameters()), e.g. "bias|norm"."""
    lr: float | None = Field(default=None, gt=0)
    """This group's learning rate (default: optim.lr)."""
    weight_decay: float | None = Field(default=None, ge=0)
    """This group's weight decay."""
    momentum: float | None = Field(default=None, ge=0, lt=1)
    """This group's momentum (sgd, rmsprop)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other options of this group, e.g. `{ betas = [0.9, 0.95] }`."""

    def check(self) -> None:
        """Rules inside one ``[[optim.groups]]``: ``match`` compiles, kwargs do not repeat named keys (ValueError)."""
        try:
            re.compile(self.match)
        except re.error as exc:
            raise ValueError(f"match {self.match!r} is no regular expression: {exc}") from None
        clash = sorted({"lr", "momentum", "weight_decay", "params"} & set(self.kwargs))
        if clash:
            raise ValueError(f"kwargs repeats {', '.join(clash)}: set it as a key of the group itself")


class OptimSpec(SpecTable):
    """``[optim]``: the optimizer: any class of torch.optim by name, or a factory of your own."""

    name: str = Field(default="sgd", min_length=1)
    """A torch.optim class by name, case-insensitive (sgd, adam, adamw, adadelta, RMSprop, NAdam, ...), or
    "pkg.module:factory" called as factory(params, lr=..., **kwargs)."""
    lr: float = Field(gt=0)
    """Learning rate (base value before any scheduler)."""
    momentum: float = Field(default=0.0, ge=0, lt=1)
    """sgd and rmsprop only: momentum factor."""
    weight_decay: float = Field(default=0.0, ge=0)
    """L2 penalty (decoupled for adamw)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments for the optimizer, e.g. `{ nesterov = true }` or `{ betas = [0.9, 0.99] }`."""
    groups: list[ParamGroupSpec] = Field(default_factory=list)
    """Parameter groups, first match wins; the other parameters keep the options above."""

    def check(self) -> None:
        """Rules inside ``[optim]``: momentum is sgd's, kwargs do not repeat named keys (ValueError)."""
        if not takes_momentum(self.name) and "momentum" in self.model_fields_set:
            raise ValueError(
                f"momentum applies to sgd and rmsprop only, not {self.name!r} (use kwargs.betas for adam and its kin)"
            )
        clash = sorted({"lr", "momentum", "weight_decay"} & set(self.kwargs))
        if clash:
            raise ValueError(f"kwargs repeats {clash}: set them as optim.{clash[0]} instead")

    @field_validator("name")
    @classmethod
    def _optimizer_name(cls, name: str) -> str:
        return without(names.optimizer_name_problem(name), name)


class SchedulerSpec(SpecTable):
    """``[scheduler]``: optional learning-rate schedule (torch.optim.lr_scheduler)."""

    name: str = Field(min_length=1)
    """A torch.optim.lr_scheduler class by name, case-insensitive (StepLR, CosineAnnealingLR, PolynomialLR,
    ...), a short name (step, multistep, exponential, cosine, onecycle, linear), or "pkg.module:factory"
    called as factory(optimizer, **kwargs)."""
    warmup_steps: int = Field(default=0, ge=0, lt=INT64_LIMIT)
    """Optimizer steps of linear warm-up from lr/(warmup_steps+1) before the schedule (SequentialLR)."""
    interval: Literal["epoch", "step"] = "epoch"
    """Call scheduler.step() after every `epoch` or every optimizer `step`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the scheduler class, e.g. `{ step_size = 10, gamma = 0.1 }`."""
    monitor: str | None = Field(default=None, min_length=1)
    """ReduceLROnPlateau only: the metric it steps on after each evaluation, e.g. "val/loss" (any metric
    logged per epoch); its `mode` ("min" or "max") is one of its kwargs."""

    def check(self) -> None:
        """Rules inside ``[scheduler]``: a warm-up counts optimizer steps, so the schedule steps per step; a plateau
        schedule steps on ``monitor`` after each evaluation, and only it reads one (ValueError)."""
        plateau = self.name.lower() == "reducelronplateau"
        if plateau and self.monitor is None:
            raise ValueError('monitor is missing: ReduceLROnPlateau steps on a metric, e.g. monitor = "val/loss"')
        if self.monitor is not None and not plateau and ":" not in self.name:
            raise ValueError(f"monitor is read by ReduceLROnPlateau only; {self.name} ignores metrics: remove it")
        if plateau and (self.warmup_steps or self.interval == "step"):
            raise ValueError(
                'interval: ReduceLROnPlateau steps after each evaluation: keep interval = "epoch", no warm-up'
            )
        if self.warmup_steps and self.interval != "step":
            raise ValueError(
                f'warmup_steps = {self.warmup_steps} counts optimizer steps: set interval = "step" (and the '
                "schedule's own sizes in steps), or drop warmup_steps"
            )

    @field_validator("name")
    @classmethod
    def _scheduler_name(cls, name: str) -> str:
        return without(names.scheduler_name_problem(name), name)


Goal = Literal["min", "max"]


class EarlyStoppingSpec(SpecTable):
    """``[early_stopping]``: end training when a metric logged per epoch stops improving (the run is FINISHED)."""

    metric: str = Field(min_length=1)
    """The metric watched, e.g. "val/loss" (any metric logged per epoch)."""
    goal: Goal = "min"
    """Whether a smaller (`min`) or larger (`max`) value is better."""
    patience: int = Field(default=3, ge=1, lt=INT64_LIMIT)
    """Evaluations in a row without improvement before training stops."""
    min_delta: float = Field(default=0.0, ge=0)
    """An improvement is a change beyond this much in the goal's direction."""


class CallbackSpec(SpecTable):
    """``[[callbacks]]``: an object of yours whose hooks training calls (on_train_start, on_validation_end,
    on_epoch_end, on_train_end), with a context that logs metrics, figures, images and files to the run."""

    name: str = Field(min_length=1)
    """"pkg.module:factory" called as factory(**kwargs) on every rank."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory."""

    @field_validator("name")
    @classmethod
    def _import_path(cls, name: str) -> str:
        return without(names.import_path_problem(name), name)


class TrainSpec(SpecTable):
    """``[train]``: the loop."""

    epochs: int = Field(default=1, ge=1)
    """Passes over the training set."""
    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimizer steps, even mid-epoch. Default: no limit."""
    grad_accum_steps: int = Field(default=1, ge=1)
    """Micro-batches accumulated per optimizer step; the global batch is split into this many."""
    amp: Literal["no", "bf16", "fp16"] = "no"
    """Mixed precision: no, bf16 (CPU and CUDA) or fp16 (CUDA, with a GradScaler)."""
    clip_grad_norm: float | None = Field(default=None, gt=0)
    """Clip the global L2 norm of gradients to this value. Default: no clipping."""
    compile: bool = False
    """torch.compile the model: the model under none, the wrapped model under ddp, each block before sharding
    under fsdp; not under dp."""
    compile_backend: str = Field(default="inductor", min_length=1)
    """train.compile only: the torch.compile backend (torch._dynamo.list_backends())."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (non-reentrant
    torch.utils.checkpoint; the blocks are parallel.fsdp_blocks under fsdp, else each direct child with
    parameters): less memory, about one more forward. Not under dp."""
    on_nonfinite: Literal["stop", "warn", "ignore"] = "stop"
    """On a non-finite loss or gradient norm: `stop` (the run FAILS), `warn` or `ignore`."""
    log_every_n_steps: int = Field(default=10, ge=1)
    """Log train/loss and lr every N optimizer steps and at the last step."""
    eval_every_n_epochs: int = Field(default=1, ge=1)
    """Evaluate on the validation split every N epochs."""
    ema_decay: float | None = Field(default=None, gt=0, lt=1)
    """Keep an exponential moving average of the weights with this decay, e.g. 0.999 (updated after each
    optimizer step); validation, the logged model and `runner export --ema` use it. Default: none."""
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """Progress display: a bar on a terminal, plain lines otherwise (auto)."""
