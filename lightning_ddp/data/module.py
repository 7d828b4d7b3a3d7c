"""``LMDataModule``: the ``--data.*`` arguments and their checks, the datasets of one source and its held-out
splits, the loaders, and the position in the data that a checkpoint saves (``ResumableDistributedSampler``: an
exact mid-epoch resume; ``docs/index.md``, "Model, data and other knobs").
"""

from __future__ import annotations

import math
import os
from typing import Callable, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_ddp.data.sources import (
    BYTE_VOCAB_SIZE,
    TOKEN_DTYPES,
    MarkovTokens,
    SyntheticTokens,
    TextBytes,
    TokenFile,
    _token_id_range,
)

#: Sources that generate their tokens and read no file.
GENERATED_SOURCES = ("synthetic", "markov")
#: Vocabulary of ``synthetic``, ``markov`` and ``tokens`` when ``--data.vocab_size`` is not given.
DEFAULT_VOCAB_SIZE = 10_000
#: The held-out splits each Lightning stage reads (``None``: the caller may run any of them).
_STAGE_SPLITS = {"fit": ("val",), "validate": ("val",), "test": ("test",), None: ("val", "test")}


class LMDataModule(LightningDataModule):
    """Language-modelling batches ``(x, y)`` of shape ``(batch_size, seq_len)`` from one source.

    Args:
        source: Where tokens come from: ``synthetic`` (uniform random, nothing to learn), ``markov`` (a random
            sparse Markov chain, learnable), ``tokens`` (flat binary token file, nanoGPT ``train.bin``) or ``text``.
        path: Training file; required for ``tokens`` and ``text``.
        val_path: Separate validation file, same format as ``path``; or hold out ``val_fraction``.
        val_fraction: Files only: fraction of the windows of ``path`` (before the test windows) held out; 0: none.
        test_path: Separate test file (for ``test``), same format as ``path``; or hold out ``test_fraction``.
        test_fraction: Files only: fraction of the windows of ``path``, from its end, held out for ``test``.
        val_samples: Generated sources only: samples held out for validation, a seed stream of their own.
        test_samples: Generated sources only: samples held out for ``test``, from yet another stream.
        token_dtype: Element type of a ``tokens`` file: ``uint16`` (vocabularies up to 65,536) or ``int32``.
        vocab_size: Vocabulary size; every token id must be below it. Default 10,000; ``text`` is always 256.
        batch_size: Samples per batch on EACH rank; the global batch is ``batch_size * world_size``.
        seq_len: Tokens per sample; must not exceed ``context_length``.
        context_length: The model's maximum context (the CLI links it from the model); checks ``seq_len``.
        num_samples: Number of samples of the ``synthetic`` and ``markov`` sources.
        markov_successors: Next tokens of each token in the ``markov`` chain (1 to 64); the loss floor is its ln.
        seed: Seeds the generated tokens, the ``markov`` chain and the shuffle order (the same on every rank).
        shuffle: Shuffle the training samples every epoch.
        num_workers: DataLoader worker processes per rank (0 loads in the training process).
    """

    def __init__(
        self,
        source: Literal["synthetic", "markov", "tokens", "text"] = "synthetic",
        path: str | None = None,
        val_path: str | None = None,
        val_fraction: float = 0.0,
        test_path: str | None = None,
        test_fraction: float = 0.0,
        val_samples: int = 256,
        test_samples: int = 256,
        token_dtype: Literal["uint16", "int32"] = "uint16",
        vocab_size: int | None = None,
        batch_size: int = 4,
        seq_len: int = 128,
        context_length: int | None = None,
        num_samples: int = 100_000,
        markov_successors: int = 4,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.source = source
        self.path = path
        self.val_path = val_path
        self.val_fraction = val_fraction
        self.test_path = test_path
        self.test_fraction = test_fraction
        self.val_samples = val_samples
        self.test_samples = test_samples
        self.token_dtype = token_dtype
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.context_length = context_length
        self.num_samples = num_samples
        self.markov_successors = markov_successors
        self.seed = seed
        self.shuffle = shuffle
        self._resume_position: tuple[int, int] | None = None  # (epoch, batches done), from a checkpoint
        self.num_workers = num_workers
        self._check_arguments(vocab_size)
        # Resolved now, not in setup(): the CLI links data.vocab_size -> model.vocab_size when it
        # instantiates the classes, before any file is read.
        self.vocab_size: int = self._resolve_vocab_size(vocab_size)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self._build_datasets()

    # ---- construction-time checks of the arguments -------------------------------------

    def _check_arguments(self, vocab_size: int | None) -> None:
        if self.source not in ("synthetic", "markov", "tokens", "text"):
            raise ValueError(
                f"--data.source {self.source!r} is not supported; choose synthetic, markov, tokens or text."
            )
        if self.token_dtype not in TOKEN_DTYPES:
            raise ValueError(
                f"--data.token_dtype {self.token_dtype!r} is not supported; choose one of "
                f"{', '.join(TOKEN_DTYPES)}."
            )
        minimums = {"batch_size": 1, "seq_len": 1, "num_samples": 1, "val_samples": 0, "test_samples": 0,
                    "num_workers": 0}
        for flag, minimum in minimums.items():
            if getattr(self, flag) < minimum:
                raise ValueError(f"--data.{flag} is {getattr(self, flag)}; set --data.{flag} to at least {minimum}.")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"--data.vocab_size is {vocab_size}; set it to at least 1.")
        if self.context_length is not None and self.seq_len > self.context_length:
            raise ValueError(
                f"--data.seq_len {self.seq_len} exceeds the model's context length "
                f"{self.context_length}; lower --data.seq_len or raise --model.context_length."
            )
        generated = self.source in GENERATED_SOURCES
        for split in ("val", "test"):
            fraction = getattr(self, f"{split}_fraction")
            if not 0.0 <= fraction < 1.0:
                raise ValueError(f"--data.{split}_fraction is {fraction}; it must be in [0, 1) (0: no {split} split).")
            if getattr(self, f"{split}_path") is not None and fraction > 0:
                raise ValueError(
                    f"both --data.{split}_path and --data.{split}_fraction are set; use a separate {split} "
                    "file or a held-out fraction, not both."
                )
            if generated and fraction > 0:
                raise ValueError(
                    f"--data.{split}_fraction is for files; --data.source {self.source} generates its held-out "
                    f"samples from a stream of their own: set --data.{split}_samples instead."
                )
        if not generated and self.path is None:
            raise ValueError(f"--data.source {self.source} reads a file; set --data.path to the training file.")
        for flag in ("path", "val_path", "test_path"):
            value = getattr(self, flag)
            if value is not None and generated:
                raise ValueError(
                    f"--data.{flag} is set but --data.source is {self.source}, which reads no file; "
                    f"set --data.source tokens or text, or drop --data.{flag}."
                )
            if value is not None and not os.path.isfile(value):
                raise FileNotFoundError(
                    f"--data.{flag} {value!r} does not exist (or is not a file); set --data.{flag} "
                    "to an existing file."
                )

    def _resolve_vocab_size(self, vocab_size: int | None) -> int:
        """The vocabulary size of the source: ``text`` is always one token per byte (another size is refused),
        the others ``vocab_size`` or the default."""
        if self.source != "text":
            return DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        if vocab_size not in (None, BYTE_VOCAB_SIZE):
            raise ValueError(
                f"--data.source text uses one token per byte, so its vocabulary is "
                f"{BYTE_VOCAB_SIZE}, but --data.vocab_size is {vocab_size}; drop --data.vocab_size "
                f"or set it to {BYTE_VOCAB_SIZE}."
            )
        return BYTE_VOCAB_SIZE

    # ---- setup: build the datasets and check the files -----------------------------------------

    def setup(self, stage: str | None = None) -> None:
        stage = getattr(stage, "value", stage)  # Lightning passes a TrainerFn, a str enum
        # The checks need the world size, known only once the trainer is attached.
        world_size, _ = self._world()
        per_rank = len(self.train_dataset) // world_size
        if stage in ("fit", None) and per_rank < self.batch_size:  # drop_last=True would yield zero steps silently
            raise ValueError(
                f"the training set has {len(self.train_dataset)} samples, {per_rank} per rank over "
                f"{world_size} rank(s): fewer than one batch of --data.batch_size "
                f"{self.batch_size}; lower --data.batch_size or --data.seq_len, or use more data."
            )
        if stage in ("validate", "test"):
            self.check_has_split(stage)
        # Each rank evaluates its own shard; a rank with none would not join the epoch-end all-reduce of the loss.
        for split in _STAGE_SPLITS.get(stage, ()):
            dataset = getattr(self, f"{split}_dataset")
            if dataset is None or len(dataset) >= world_size:
                continue
            flag = f"--data.{split}"
            if self.source in GENERATED_SOURCES:
                fix = f"raise {flag}_samples to at least {world_size}"
            elif getattr(self, f"{split}_path") is not None:
                fix = f"use a {flag}_path file of at least {world_size} windows of --data.seq_len + 1 tokens"
            else:
                fix = f"raise {flag}_fraction"
            raise ValueError(
                f"the {split} split has {len(dataset)} samples, fewer than the {world_size} ranks: some rank would "
                f"get none; {fix}."
            )

    def _build_datasets(self) -> None:
        # Done at construction, before the Trainer starts: a bad file then fails before any process is launched
        # or any log file is created. Memory-mapped files cost nothing to open; only the id scan reads them.
        if self.source not in GENERATED_SOURCES:
            self.train_dataset, self.val_dataset, self.test_dataset = self._file_splits(self._open_file(self.path))
            return
        if self.source == "synthetic":
            train = SyntheticTokens(self.num_samples, self.seq_len, self.vocab_size, self.seed)
        else:
            train = MarkovTokens(
                self.num_samples, self.seq_len, self.vocab_size, self.seed, successors=self.markov_successors
            )
        # Each held-out split is its own stream of the same seed (the same Markov chain), so it does not change with
        # --data.num_samples and never repeats a training sample.
        self.train_dataset = train
        self.val_dataset = train.held_out("val", self.val_samples) if self.val_samples > 0 else None
        self.test_dataset = train.held_out("test", self.test_samples) if self.test_samples > 0 else None

    def _open_file(self, path: str) -> TokenFile:
        if self.source == "text":
            return TextBytes(path, self.seq_len)  # bytes are always < 256: nothing to scan
        dataset = TokenFile(path, self.seq_len, self.token_dtype)
        low, high = _token_id_range(dataset.tokens)
        if high >= self.vocab_size:
            raise ValueError(
                f"{path} holds token id {high} but --data.vocab_size is {self.vocab_size} "
                f"(ids must be below it); set --data.vocab_size to at least {high + 1} (the "
                "tokenizer's vocabulary size)."
            )
        if low < 0:  # only possible for int32 files
            raise ValueError(
                f"{path} holds a negative token id ({low}); was it written with another dtype? "
                "Check --data.token_dtype."
            )
        return dataset

    def _file_splits(self, dataset: TokenFile) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """(train, val, test) of a file source: separate files, or ``path``'s windows cut ``[train | val | test]``
        (at least one test window when ``test_fraction`` > 0)."""
        num_windows = len(dataset)
        num_val = math.ceil(num_windows * self.val_fraction) if self.val_path is None else 0
        num_test = math.ceil(num_windows * self.test_fraction) if self.test_path is None else 0
        num_train = num_windows - num_val - num_test
        if num_train < 1:
            raise ValueError(
                f"--data.val_fraction {self.val_fraction} and --data.test_fraction {self.test_fraction} of "
                f"{num_windows} samples leave none for training; lower them or use more data."
            )
        # Contiguous tails (not random subsets) keep held-out text unseen in training, apart from the single
        # token at each boundary that ends the last window before it.
        val_end = num_train + num_val
        val = self._open_file(self.val_path) if self.val_path else Subset(dataset, range(num_train, val_end))
        test = self._open_file(self.test_path) if self.test_path else Subset(dataset, range(val_end, num_windows))
        train = dataset if num_train == num_windows else Subset(dataset, range(num_train))
        return train, (val if len(val) else None), (test if len(test) else None)

    def check_has_split(self, stage: str) -> None:
        """Refuse ``validate`` or ``test`` (``stage``) when its split is missing: it would evaluate nothing and exit
        as if it had. Raises ``ValueError`` naming the flags that add one."""
        split = _STAGE_SPLITS[stage][0]
        if getattr(self, f"{split}_dataset") is not None:
            return
        flag = f"--data.{split}"  # the split's _samples (generated sources), _fraction and _path (files)
        if self.source in GENERATED_SOURCES:
            fix = f"set {flag}_samples above 0"
        else:
            fix = f"set {flag}_fraction (a held-out tail of --data.path) or {flag}_path (a separate file)"
        raise ValueError(f"`{stage}` needs a {split} split, but this data has none: {fix}.")

    # ---- dataloaders ----------------------------------------------------------------------------

    def _world(self) -> tuple[int, int]:
        """(world size, this rank), (1, 0) without a trainer."""
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)

    def _loader(self, dataset: Dataset, sampler: DistributedSampler, drop_last: bool = False) -> DataLoader:
        # Persistent workers: kept across epochs instead of restarted (and reopening the files).
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=drop_last,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        """This rank's shuffled share of the training set in full batches, resuming mid-epoch at the position
        a loaded checkpoint recorded (once)."""
        world_size, rank = self._world()
        sampler = ResumableDistributedSampler(
            self.train_dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch_source=(lambda: self.trainer.current_epoch) if self.trainer else None,
        )
        if self._resume_position is not None:
            epoch, batches_done = self._resume_position
            sampler.skip(epoch, batches_done * self.batch_size)
            self._resume_position = None
        # drop_last: every step sees full batches, so all ranks do equal work and throughput is comparable.
        return self._loader(self.train_dataset, sampler, drop_last=True)

    def state_dict(self) -> dict[str, int]:
        """Where training is in the data: the epoch, and the batches of it already trained on (per rank)."""
        if self.trainer is None:
            return {}
        batch_progress = self.trainer.fit_loop.epoch_loop.batch_progress
        # `processed` counts batches whose training step ran; a checkpoint written in on_train_batch_end
        # includes the current batch. (`ready` would also count the batch the loader prefetched.)
        return {"epoch": self.trainer.current_epoch, "batches_done": batch_progress.current.processed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Remember where a checkpoint's training was in the data; the next training loader skips what was trained."""
        if state_dict:
            self._resume_position = (int(state_dict["epoch"]), int(state_dict["batches_done"]))

    def val_dataloader(self) -> DataLoader | list:
        # Lightning 2.x reads an empty list as "no validation" and skips the loop during fit (it warns once that
        # the total length is zero; that is expected here). `validate` without a split stops in setup().
        return self._eval_dataloader(self.val_dataset)

    def test_dataloader(self) -> DataLoader | list:
        """This rank's share of the test split, in order; ``[]`` without one."""
        return self._eval_dataloader(self.test_dataset)

    def _eval_dataloader(self, dataset: Dataset | None) -> DataLoader | list:
        """``dataset`` in order, every rank the same number of batches; ``[]`` for no dataset."""
        if dataset is None:
            return []
        world_size, rank = self._world()
        # Rank r evaluates samples r, r + world, r + 2 * world, ... in order; the last len % world samples are left
        # out, so every rank runs the same number of batches and none is counted twice (Lightning's own sampler
        # would pad the shards by repeating samples). A DistributedSampler, so Lightning keeps it.
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
        return self._loader(dataset, sampler)


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
        """This rank's indices of the epoch (``epoch_source``'s, if given), less those ``skip`` left out."""
        if self.epoch_source is not None:
            self.epoch = self.epoch_source()
        indices = list(super().__iter__())
        if self.epoch == self._skip_epoch:
            indices = indices[self._skip_samples :]
        return iter(indices)

    # __len__ stays the full epoch: Lightning reads it once as the epoch's length and, on resume, continues
    # counting batches from where the checkpoint was, so the skipped ones must still count.
