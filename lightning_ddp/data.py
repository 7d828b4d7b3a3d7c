"""Language-modelling data: four token sources behind one ``LightningDataModule``.

Sources (``--data.source``):

1. ``synthetic``: uniform random tokens in ``[0, vocab_size)``. Sample ``i`` is drawn from a
   generator seeded from ``(seed, i)``, so every rank can rebuild any sample on its own, in any
   order, with no file and no communication. Good for benchmarking the gradient sync, where the
   data only has to have the right shape; nothing in it can be learnt (the loss stays at
   ``ln(vocab_size)``).
2. ``markov``: walks on a seeded random sparse Markov chain over the vocabulary: every token has
   ``markov_successors`` possible next tokens, equally likely. Generated like ``synthetic`` (sample
   ``i`` from ``(seed, i)``, no file), but learnable: the loss falls from ``ln(vocab_size)`` towards
   the chain's entropy, ``ln(markov_successors)`` nats per token (see ``MarkovTokens``).
3. ``tokens``: a flat binary file of token ids, ``np.uint16`` or ``np.int32`` (the nanoGPT
   ``train.bin`` convention), memory-mapped so a file larger than RAM costs no memory.
4. ``text``: a plain text file read as raw bytes: vocabulary 256, no tokenizer needed.

Windowing: every sample is a window of ``seq_len + 1`` consecutive tokens, split into the input
``x = window[:-1]`` and the target ``y = window[1:]`` (the next token at every position). Files are
cut into non-overlapping windows: window ``i`` starts at token ``i * seq_len``, so a file of ``n``
tokens holds ``(n - 1) // seq_len`` samples (neighbouring windows share one token: the last target
of window ``i`` is the first input of window ``i + 1``).

Validation: either a separate file (``--data.val_path``) or the last ``val_fraction`` of the
windows, which are then removed from the training set.

Rank-disjointness: the training loader carries its own ``ResumableDistributedSampler`` (a
``DistributedSampler``, so Lightning keeps it rather than injecting another). With ``world`` ranks it
orders the indices (a permutation seeded from ``--data.seed`` and the epoch when shuffling; ``0, 1, 2,
...`` otherwise), identical on every rank, and gives rank ``r`` the entries at positions ``r, r + world,
r + 2 * world, ...``. The ranks therefore see disjoint samples, and together one step's
``world * batch_size`` samples form the global batch. If the dataset size is not a multiple of
``world``, the sampler drops the tail so every rank gets the same number of samples.

Exact resume: the data module's ``state_dict`` (saved in every Lightning checkpoint) records the epoch
and how many batches of it were trained; on ``--ckpt_path`` resume the sampler skips exactly those, so
training continues with the next unseen sample instead of restarting the epoch.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DistributedSampler, DataLoader, Dataset, Subset

__all__ = ["LMDataModule", "MarkovTokens", "SyntheticTokens", "TextBytes", "TokenFile", "write_token_file"]

#: Token file dtypes, by the name ``--data.token_dtype`` takes.
TOKEN_DTYPES = ("uint16", "int32")
#: Vocabulary of ``source="text"``: one token per byte value.
BYTE_VOCAB_SIZE = 256
#: Most successors per token of ``source="markov"``: drawing distinct successors by rejection costs
#: ~0.2 s for 64 successors of 10,000 tokens but grows with their square, and ln(64) = 4.2 nats is
#: already a high floor.
MAX_MARKOV_SUCCESSORS = 64
#: Sources that generate their tokens and read no file.
GENERATED_SOURCES = ("synthetic", "markov")
#: Vocabulary of ``synthetic``, ``markov`` and ``tokens`` when ``--data.vocab_size`` is not given.
DEFAULT_VOCAB_SIZE = 10_000
# Tokens read per step when scanning a file for out-of-range ids: 4M tokens (8-16 MB) keeps the
# scan's memory small however large the memory-mapped file is.
_SCAN_CHUNK_TOKENS = 1 << 22


class SyntheticTokens(Dataset):
    """Uniform random token windows, reproducible per sample.

    Sample ``i`` comes from a ``torch.Generator`` seeded with ``seed * 1_000_003 + i``, so it
    depends only on ``(seed, i)``: not on access order, worker, or rank.

    Args:
        num_samples: Number of samples (the dataset's length).
        seq_len: Tokens per sample input ``x`` (and target ``y``).
        vocab_size: Tokens are drawn uniformly from ``[0, vocab_size)``.
        seed: Seed of the whole dataset; a different seed gives different samples.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        # A prime multiplier keeps (seed, i) -> generator seed one-to-one for any realistic size.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        window = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return window[:-1], window[1:]


class MarkovTokens(Dataset):
    """Walks on a seeded random sparse Markov chain: learnable tokens, reproducible per sample.

    The chain, built once from ``seed``:

    1. rank the vocabulary in a random order and give the token of rank ``r`` (1-based) the Zipf weight
       ``1 / r ** zipf_exponent``, normalised to sum to 1; as in text, a few tokens are frequent;
    2. give every token ``successors`` *distinct* next tokens, drawn with those weights;
    3. a walk starts at a token drawn with the same weights and moves to one of the current token's
       successors, each with probability ``1 / successors``.

    Sample ``i`` is the walk drawn from a generator seeded with ``(seed, i)``, so, as for
    ``SyntheticTokens``, it depends only on ``(seed, i)``: not on access order, worker or rank.

    What loss to expect: given the current token, the next one is uniform over ``successors`` tokens,
    so no model can beat ``ln(successors)`` nats per token (1.39 for the default 4): that is the
    floor. An untrained model starts at ``ln(vocab_size)`` (9.21 for 10,000). The Zipf weights make
    the loss fall fast: for vocabulary 10,000 and 4 successors, 100 tokens carry about 3/4 of a long
    walk, so learning their frequencies alone brings the loss to the walk's unigram entropy (about
    5.2-5.3 nats, depending on the seed), and learning their successors takes it below that. Measured
    with the quickstart (``tiny`` model, 40 steps of 16 x 128 tokens, lr 3e-3): 9.22 at the first step,
    3.45 averaged over the last five.

    Args:
        num_samples: Number of samples (the dataset's length).
        seq_len: Tokens per sample input ``x`` (and target ``y``).
        vocab_size: Tokens are in ``[0, vocab_size)``.
        seed: Seed of the chain and of the walks; a different seed gives another chain.
        successors: Possible next tokens of every token, from 1 to ``vocab_size`` and at most
            ``MAX_MARKOV_SUCCESSORS`` (64).
        zipf_exponent: How skewed the token frequencies are. 0 makes all tokens equally likely, which
            is far slower to learn, every row of the chain being as rare as the others: in the
            quickstart's 40 steps the loss then only gets from 9.2 to 8.1.
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int,
        vocab_size: int,
        seed: int = 0,
        successors: int = 4,
        zipf_exponent: float = 1.0,
    ) -> None:
        if not 1 <= successors <= min(vocab_size, MAX_MARKOV_SUCCESSORS):
            raise ValueError(
                f"--data.markov_successors is {successors}; set it between 1 and "
                f"{min(vocab_size, MAX_MARKOV_SUCCESSORS)} (at most {MAX_MARKOV_SUCCESSORS}, and at most the "
                "vocabulary size: every token needs that many distinct successors)."
            )
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.successors = successors
        # SeedSequence takes non-negative integers only; seed mod 2**64 is one-to-one for any 64-bit seed.
        self._entropy = seed % 2**64
        # Stream 0 builds the chain, stream 1 draws the walks: [entropy, stream, index] never repeats.
        rng = np.random.default_rng([self._entropy, 0, 0])
        ranking = rng.permutation(vocab_size)  # ranking[r] is the token of Zipf rank r + 1
        weights = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64) ** zipf_exponent
        self._cdf = np.cumsum(weights / weights.sum())
        self._ranking = ranking
        #: ``next_tokens[t]`` holds the ``successors`` distinct tokens that may follow token ``t``.
        self.next_tokens = ranking[_distinct_weighted_draws(rng, self._cdf, vocab_size, successors)]

    def _draw_by_weight(self, uniform: float) -> int:
        # Inverse-CDF sampling; min() guards the last bucket against the cumsum's rounding below 1.0.
        rank = min(int(np.searchsorted(self._cdf, uniform, side="right")), self.vocab_size - 1)
        return int(self._ranking[rank])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self._entropy, 1, index])
        start = self._draw_by_weight(rng.random())
        choices = rng.integers(0, self.successors, size=self.seq_len).tolist()
        # A walk is sequential: one table lookup per token, ~0.5 us each (~70 us for 128 tokens).
        table = self.next_tokens
        window = [start]
        for choice in choices:
            window.append(int(table[window[-1], choice]))
        window = torch.tensor(window, dtype=torch.int64)
        return window[:-1], window[1:]


def _distinct_weighted_draws(rng: np.random.Generator, cdf: np.ndarray, rows: int, per_row: int) -> np.ndarray:
    """``(rows, per_row)`` ranks drawn by the weights whose cumulative sum is ``cdf``, distinct within each row.

    Column by column: draw every row's entry, then redraw only the entries that repeat an earlier column
    of their row. An entry takes ``1 / (1 - w)`` draws on average, ``w`` the weight its row has already taken.
    """
    size = len(cdf)
    ranks = np.empty((rows, per_row), dtype=np.int64)
    for column in range(per_row):
        pending = np.arange(rows)
        while pending.size:
            draw = np.minimum(np.searchsorted(cdf, rng.random(pending.size), side="right"), size - 1)
            ranks[pending, column] = draw
            repeats = (ranks[pending, :column] == draw[:, None]).any(axis=1)
            pending = pending[repeats]
    return ranks


class TokenFile(Dataset):
    """Non-overlapping windows over a flat binary file of token ids.

    The file is a raw array with no header (nanoGPT's ``train.bin``; see ``write_token_file``).
    Sample ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``, returned as int64
    ``(x, y) = (window[:-1], window[1:])``.

    Args:
        path: The token file.
        seq_len: Tokens per sample input ``x`` (and target ``y``).
        dtype: Element type the file was written with: ``"uint16"`` (vocabularies up to 65,536,
            e.g. GPT-2) or ``"int32"``; ``"uint8"`` reads any file as bytes (see ``TextBytes``).
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: str = "uint16") -> None:
        self.path = os.fspath(path)
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        num_bytes = os.path.getsize(self.path)
        if num_bytes % self.dtype.itemsize:
            raise ValueError(_dtype_mismatch_message(self.path, num_bytes, self.dtype.name))
        self.num_tokens = num_bytes // self.dtype.itemsize
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"{self.path} has {self.num_tokens} tokens but one sample needs seq_len + 1 = "
                f"{seq_len + 1}; use a longer file or a smaller --data.seq_len."
            )
        # Opened lazily in each process (see `tokens`), never pickled.
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        """The whole file as a read-only memory-mapped 1-D array."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> dict:
        # Pickling an np.memmap copies the whole file into the pickle. DataLoader workers started
        # with "spawn" (macOS, Windows, ddp_spawn) pickle the dataset, so drop the map and let
        # each worker reopen the file.
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        # The last window's target needs one token beyond its input, hence the -1.
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        start = index * self.seq_len
        # int64 copy: torch indexes embeddings with int64, and the copy detaches from the memmap.
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class TextBytes(TokenFile):
    """A plain text file as byte tokens (vocabulary 256, no tokenizer), windowed like ``TokenFile``.

    Args:
        path: The text file; any encoding works, each byte is one token.
        seq_len: Tokens (bytes) per sample input ``x`` (and target ``y``).
    """

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, path: str | os.PathLike, seq_len: int) -> None:
        super().__init__(path, seq_len, dtype="uint8")


def write_token_file(
    path: str | os.PathLike, tokens: np.ndarray | list[int], dtype: str = "uint16"
) -> None:
    """Write ``tokens`` to ``path`` as a flat, headerless binary array (the ``TokenFile`` format).

    Raises ``ValueError`` rather than silently wrapping ids that do not fit ``dtype``.
    """
    tokens = np.asarray(tokens)
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"token ids must be >= 0, got {tokens.min()}.")
    if tokens.size and tokens.max() > np.iinfo(dtype).max:
        raise ValueError(
            f"token id {tokens.max()} does not fit {dtype} (max {np.iinfo(dtype).max}); "
            "write with dtype='int32'."
        )
    tokens.astype(dtype).ravel().tofile(path)


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can skip the first samples of one epoch (to resume mid-epoch exactly).

    Always ``drop_last=True``: every rank gets ``len(dataset) // num_replicas`` samples, none repeated.

    ``epoch_source``, when given, is read at the start of every epoch instead of the value passed to
    ``set_epoch``. The data module passes ``trainer.current_epoch``. Lightning calls ``set_epoch`` with its count of
    *processed* epochs, and a run stopped by ``max_steps`` mid-epoch counts that epoch as processed. Resuming
    from its checkpoint would then shuffle the rest of the epoch with the next epoch's permutation.
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


class LMDataModule(LightningDataModule):
    """Language-modelling batches ``(x, y)`` of shape ``(batch_size, seq_len)`` from one source.

    See the module docstring for the sources, the windowing, and how DDP shards the samples.

    Args:
        source: Where tokens come from: ``synthetic`` (uniform random, no file, nothing to learn),
            ``markov`` (walks on a random sparse Markov chain, no file, learnable down to a loss of
            ``ln(markov_successors)``), ``tokens`` (flat binary token file, nanoGPT ``train.bin``) or
            ``text`` (a text file as bytes, vocabulary 256).
        path: Training file; required for ``tokens`` and ``text``.
        val_path: Separate validation file, same format as ``path``. Leave unset to hold out
            ``val_fraction`` of the training windows instead.
        val_fraction: Fraction of the training windows, taken from the end of the data, held out
            for validation. 0 means no validation.
        token_dtype: Element type of a ``tokens`` file: ``uint16`` (vocabularies up to 65,536) or
            ``int32``.
        vocab_size: Vocabulary size; every token id must be below it. Defaults to 10,000 for
            ``synthetic``, ``markov`` and ``tokens``; ``text`` is always 256. The CLI passes the resolved
            value on to ``--model.vocab_size``.
        batch_size: Samples per batch on EACH rank (process); the global batch is
            ``batch_size * world_size``.
        seq_len: Tokens per sample; must not exceed ``context_length``.
        context_length: The model's maximum context (the CLI links it from the model); only
            used to check ``seq_len``.
        num_samples: Number of samples of the ``synthetic`` and ``markov`` sources.
        markov_successors: Possible next tokens of every token in the ``markov`` chain (1 to 64); the
            loss cannot fall below ``ln(markov_successors)`` nats (1.39 for 4).
        seed: Seeds the generated tokens (and the ``markov`` chain) and the shuffle order (the same
            on every rank).
        shuffle: Shuffle the training samples every epoch.
        num_workers: DataLoader worker processes per rank (0 loads in the training process).
    """

    def __init__(
        self,
        source: Literal["synthetic", "markov", "tokens", "text"] = "synthetic",
        path: str | None = None,
        val_path: str | None = None,
        val_fraction: float = 0.0,
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
        for flag, value, minimum in (
            ("batch_size", self.batch_size, 1),
            ("seq_len", self.seq_len, 1),
            ("num_samples", self.num_samples, 1),
            ("num_workers", self.num_workers, 0),
        ):
            if value < minimum:
                raise ValueError(f"--data.{flag} is {value}; set --data.{flag} to at least {minimum}.")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"--data.vocab_size is {vocab_size}; set it to at least 1.")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(
                f"--data.val_fraction is {self.val_fraction}; it must be in [0, 1) (0 = no validation)."
            )
        if self.context_length is not None and self.seq_len > self.context_length:
            raise ValueError(
                f"--data.seq_len {self.seq_len} exceeds the model's context length "
                f"{self.context_length}; lower --data.seq_len or raise --model.context_length."
            )
        if self.val_path is not None and self.val_fraction > 0:
            raise ValueError(
                "both --data.val_path and --data.val_fraction are set; use a separate validation "
                "file or a held-out fraction, not both."
            )
        if self.source in GENERATED_SOURCES:
            for flag, value in (("path", self.path), ("val_path", self.val_path)):
                if value is not None:
                    raise ValueError(
                        f"--data.{flag} is set but --data.source is {self.source}, which reads no file; "
                        f"set --data.source tokens or text, or drop --data.{flag}."
                    )
            return
        if self.path is None:
            raise ValueError(
                f"--data.source {self.source} reads a file; set --data.path to the training file."
            )
        for flag, value in (("path", self.path), ("val_path", self.val_path)):
            if value is not None and not os.path.isfile(value):
                raise FileNotFoundError(
                    f"--data.{flag} {value!r} does not exist (or is not a file); set --data.{flag} "
                    "to an existing file."
                )

    def _resolve_vocab_size(self, vocab_size: int | None) -> int:
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
        self._check_enough_for_one_batch()  # needs the world size, known only once the trainer is attached

    def _build_datasets(self) -> None:
        # Done at construction, before the Trainer starts: a bad file then fails before any process is launched
        # or any log file is created. Memory-mapped files cost nothing to open; only the id scan reads them.
        if self.source == "synthetic":
            train = SyntheticTokens(self.num_samples, self.seq_len, self.vocab_size, self.seed)
        elif self.source == "markov":
            train = MarkovTokens(
                self.num_samples, self.seq_len, self.vocab_size, self.seed, successors=self.markov_successors
            )
        else:
            train = self._open_file(self.path)
        if self.val_path is not None:
            self.train_dataset, self.val_dataset = train, self._open_file(self.val_path)
        elif self.val_fraction > 0:
            self.train_dataset, self.val_dataset = self._split_tail(train)
        else:
            self.train_dataset = train

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

    def _split_tail(self, dataset: Dataset) -> tuple[Subset, Subset]:
        """Hold out the last ``val_fraction`` of the windows (at least one) for validation."""
        num_windows = len(dataset)
        num_val = math.ceil(num_windows * self.val_fraction)
        num_train = num_windows - num_val
        if num_train < 1:
            raise ValueError(
                f"--data.val_fraction {self.val_fraction} of {num_windows} samples leaves none for "
                "training; lower --data.val_fraction or use more data."
            )
        # A contiguous tail (not a random subset) keeps validation text unseen in training, apart
        # from the single token at the boundary that ends the last training window.
        return (
            Subset(dataset, range(num_train)),
            Subset(dataset, range(num_train, num_windows)),
        )

    def _check_enough_for_one_batch(self) -> None:
        # drop_last=True would silently yield zero training steps; say so instead.
        world_size = self.trainer.world_size if self.trainer is not None else 1
        per_rank = len(self.train_dataset) // world_size
        if per_rank < self.batch_size:
            raise ValueError(
                f"the training set has {len(self.train_dataset)} samples, {per_rank} per rank over "
                f"{world_size} rank(s): fewer than one batch of --data.batch_size "
                f"{self.batch_size}; lower --data.batch_size or --data.seq_len, or use more data."
            )

    # ---- dataloaders ----------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        world_size, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
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
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            # Every step sees full batches, so all ranks do equal work and throughput is comparable.
            drop_last=True,
            num_workers=self.num_workers,
            # Keep workers across epochs instead of restarting them (and reopening the files).
            persistent_workers=self.num_workers > 0,
        )

    def state_dict(self) -> dict[str, int]:
        """Where training is in the data: the epoch, and the batches of it already trained on (per rank)."""
        if self.trainer is None:
            return {}
        batch_progress = self.trainer.fit_loop.epoch_loop.batch_progress
        # `processed` counts batches whose training step ran; a checkpoint written in on_train_batch_end
        # includes the current batch. (`ready` would also count the batch the loader prefetched.)
        return {"epoch": self.trainer.current_epoch, "batches_done": batch_progress.current.processed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict:
            self._resume_position = (int(state_dict["epoch"]), int(state_dict["batches_done"]))

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            # Lightning 2.x reads an empty list as "no validation" and skips the loop (it warns
            # once that the total length is zero; that is expected here).
            return []
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


def _token_id_range(tokens: np.ndarray, chunk_tokens: int = _SCAN_CHUNK_TOKENS) -> tuple[int, int]:
    """Smallest and largest id in ``tokens``, read a chunk at a time so a memmap stays on disk."""
    low, high = None, None
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        chunk_low, chunk_high = int(chunk.min()), int(chunk.max())
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
    assert low is not None and high is not None, "callers pass a non-empty array"
    return low, high


def _dtype_mismatch_message(path: str, num_bytes: int, dtype: str) -> str:
    itemsize = np.dtype(dtype).itemsize
    fits = [name for name in TOKEN_DTYPES if num_bytes % np.dtype(name).itemsize == 0]
    if fits:
        fix = f"it was probably written as {' or '.join(fits)}: set --data.token_dtype {fits[0]}."
    else:
        fix = "it is no token file of any supported dtype; for a text file set --data.source text."
    return (
        f"{path} is {num_bytes} bytes, not a multiple of the {itemsize}-byte {dtype} tokens; {fix}"
    )
