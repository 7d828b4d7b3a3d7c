"""``ResumableDistributedSampler``: every rank its own disjoint share of the samples, and an exact mid-epoch resume
(``docs/index.md``, "Model, data and other knobs")."""

from __future__ import annotations

from typing import Callable

from torch.utils.data import Dataset, DistributedSampler

__all__ = ["ResumableDistributedSampler"]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can skip the first samples of one epoch (to resume mid-epoch exactly).

    Always ``drop_last=True``. ``epoch_source``, when given, is read at the start of every epoch instead of the value
    passed to ``set_epoch`` (the data module passes ``trainer.current_epoch``; ``docs/index.md`` says why).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        epoch_source: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.epoch_source = epoch_source
        self._skip_epoch: int | None = None
        self._skip_samples = 0

    def skip(self, epoch: int, samples: int) -> None:
        """In epoch ``epoch``, leave out this rank's first ``samples`` samples (those already trained on)."""
        self._skip_epoch, self._skip_samples = epoch, samples

    def __iter__(self):
        if self.epoch_source is not None:
            self.epoch = self.epoch_source()
        indices = list(super().__iter__())
        if self.epoch == self._skip_epoch:
            indices = indices[self._skip_samples :]
        return iter(indices)

    # __len__ stays the full epoch: Lightning reads it once as the epoch's length and, on resume, continues
    # counting batches from where the checkpoint was, so the skipped ones must still count.
