"""Pruning a sweep trial: after each epoch, report the sweep's metric to Optuna and ask its pruner whether to stop.

:class:`OptunaPruning` is the ``epoch_end`` a trial hands to ``runner exec``
(:class:`runner.launch.driver.ExecOptions`): the core calls it on the logging rank after each
epoch and stops every rank when it says so. It is picklable, so a ddp trial's rank 0 (another
process) reopens the study by its storage URL (Optuna's ``Trial.report`` and
``Trial.should_prune``; docs/design.md §16).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna


class OptunaPruning:
    """Report ``metric`` of each epoch as the trial's intermediate value (step = epoch) and return the pruner's verdict.

    Args:
        url: The study's storage URL.
        study_name: The study.
        trial_number: The trial's number in the study.
        definition: The sweep definition's JSON (metric, pruner and its settings).
        trial: The live Optuna trial when the epochs run in this process (not pickled).
    """

    def __init__(
        self,
        url: str,
        study_name: str,
        trial_number: int,
        definition: dict[str, Any],
        trial: optuna.Trial | None = None,
    ):
        self.url, self.study_name, self.trial_number, self.definition = url, study_name, trial_number, definition
        self._trial = trial

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_trial"] = None  # another process opens the study itself
        return state

    def __call__(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Whether the trial stops after ``epoch`` (0-based): False while the metric is not logged or not finite.

        Raises:
            StorageError: The study cannot be reopened in this process.
        """
        value = metrics.get(self.definition["metric"])
        if value is None or not math.isfinite(float(value)):
            return False
        trial = self._trial or self._reopen()
        trial.report(float(value), step=epoch)
        return bool(trial.should_prune())

    def _reopen(self) -> optuna.Trial:
        """The trial, from its study in the storage (for a rank 0 that is not the sweep worker's process)."""
        import optuna

        from runner.tools.sweep_space import SweepDefinition
        from runner.tools.sweep_storage import make_pruner, open_storage

        storage = open_storage(self.url, heartbeat=False)
        pruner = make_pruner(SweepDefinition.from_json(self.definition))
        study = optuna.load_study(
            study_name=self.study_name, storage=storage, pruner=pruner, sampler=optuna.samplers.RandomSampler()
        )
        study_id = storage.get_study_id_from_name(self.study_name)
        self._trial = optuna.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, self.trial_number))
        return self._trial
