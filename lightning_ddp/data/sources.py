"""The token sources: map-style ``Dataset``s whose sample ``i`` is a window ``(x, y)`` of ``seq_len`` tokens, generated
from ``(seed, split, i)`` alone (``SyntheticTokens``, ``MarkovTokens``) or memory-mapped from a file (``TokenFile``,
nanoGPT's ``train.bin``; ``TextBytes``, a text file as bytes).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import torch
from torch.utils.data import Dataset

#: Token file dtypes, by the name ``--data.token_dtype`` takes.
TOKEN_DTYPES = ("uint16", "int32")
#: Vocabulary of ``source="text"``: one token per byte value.
BYTE_VOCAB_SIZE = 256
#: Most successors per token of ``source="markov"`` (drawing them costs their square; ln(64) is a high floor).
MAX_MARKOV_SUCCESSORS = 64
#: The splits of a generated source, each its own stream of samples drawn from the same seed.
SPLITS = ("train", "val", "test")


def _check_index(index: int, length: int) -> None:
    if not 0 <= index < length:
        raise IndexError(f"index {index} out of range for {length} samples")


def _held_out_seed(seed: int, split: str, index: int) -> int:
    """The generator seed of sample ``index`` of a held-out split: a 64-bit hash of ``(seed, split, index)``."""
    words = [seed % 2**64, SPLITS.index(split), index]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0])


class _GeneratedTokens(Dataset):
    """``num_samples`` windows of ``split``; sample ``i`` depends only on ``(seed, split, i)``, not on order, worker
    or rank."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0, split: str = "train") -> None:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}.")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.split = split

    def held_out(self, split: str, num_samples: int):
        """The ``split`` (``val`` or ``test``) of this dataset, ``num_samples`` long (a Markov chain's shared)."""
        if split == "train":
            raise ValueError("held_out() gives a held-out split: 'val' or 'test', not 'train'.")
        other = copy.copy(self)  # shallow: a Markov chain's tables are shared, never written
        _GeneratedTokens.__init__(other, num_samples, self.seq_len, self.vocab_size, self.seed, split)
        return other

    def __len__(self) -> int:
        return self.num_samples


class SyntheticTokens(_GeneratedTokens):
    """Uniform random token windows."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_index(index, self.num_samples)
        if self.split == "train":
            # A prime multiplier keeps (seed, i) -> generator seed one-to-one for any realistic size.
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        else:
            generator = torch.Generator().manual_seed(_held_out_seed(self.seed, self.split, index))
        window = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return window[:-1], window[1:]


class MarkovTokens(_GeneratedTokens):
    """Walks on a seeded random sparse Markov chain: learnable tokens, reproducible per sample.

    The chain, built from ``seed`` alone: tokens get Zipf weights ``1 / rank`` in a random order;
    every token gets ``successors`` distinct next tokens drawn with those weights; a walk starts at a weighted draw
    and moves to a uniformly chosen successor. Sample ``i`` is the walk seeded from ``(seed, split, i)``. No model
    can beat ``ln(successors)`` nats per token; an untrained one starts at ``ln(vocab_size)``.
    ``successors``: 1 to ``MAX_MARKOV_SUCCESSORS``.
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int,
        vocab_size: int,
        seed: int = 0,
        successors: int = 4,
        split: str = "train",
    ) -> None:
        super().__init__(num_samples, seq_len, vocab_size, seed, split)
        if not 1 <= successors <= min(vocab_size, MAX_MARKOV_SUCCESSORS):
            raise ValueError(
                f"--data.markov_successors is {successors}; set it between 1 and "
                f"{min(vocab_size, MAX_MARKOV_SUCCESSORS)} (at most {MAX_MARKOV_SUCCESSORS}, and at most the "
                "vocabulary size: every token needs that many distinct successors)."
            )
        self.successors = successors
        # SeedSequence takes non-negative integers only; seed mod 2**64 is one-to-one for any 64-bit seed.
        self._entropy = seed % 2**64
        rng = np.random.default_rng([self._entropy, 0, 0])  # stream 0 builds the chain; 1, 2, 3: the splits' walks
        ranking = rng.permutation(vocab_size)  # ranking[r] is the token of Zipf rank r + 1
        weights = 1.0 / np.arange(1, vocab_size + 1, dtype=np.float64)
        self._cdf = np.cumsum(weights / weights.sum())
        self._ranking = ranking
        #: ``next_tokens[t]`` holds the ``successors`` distinct tokens that may follow token ``t``.
        self.next_tokens = ranking[_distinct_weighted_draws(rng, self._cdf, vocab_size, successors)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_index(index, self.num_samples)
        rng = np.random.default_rng([self._entropy, 1 + SPLITS.index(self.split), index])
        # The start by weight (inverse CDF; min() guards the last bucket against the cumsum's rounding below 1.0).
        start = min(int(np.searchsorted(self._cdf, rng.random(), side="right")), self.vocab_size - 1)
        choices = rng.integers(0, self.successors, size=self.seq_len).tolist()
        # A walk is sequential: one table lookup per token, ~0.5 us each (~70 us for 128 tokens).
        table = self.next_tokens
        window = [int(self._ranking[start])]
        for choice in choices:
            window.append(int(table[window[-1], choice]))
        window = torch.tensor(window, dtype=torch.int64)
        return window[:-1], window[1:]


def _distinct_weighted_draws(rng: np.random.Generator, cdf: np.ndarray, rows: int, per_row: int) -> np.ndarray:
    """``(rows, per_row)`` ranks drawn by the weights whose cumulative sum is ``cdf``, distinct within each row."""
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
    """Non-overlapping windows over a flat binary file of token ids (no header, nanoGPT's ``train.bin``).

    Sample ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]`` as int64 ``(window[:-1], window[1:])``;
    ``dtype``: ``"uint16"``, ``"int32"``, or ``"uint8"`` to read any file as bytes.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: str = "uint16") -> None:
        self.path = os.fspath(path)
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        num_bytes = os.path.getsize(self.path)
        if num_bytes % self.dtype.itemsize:
            fits = [name for name in TOKEN_DTYPES if num_bytes % np.dtype(name).itemsize == 0]
            fix = (f"it was probably written as {' or '.join(fits)}: set --data.token_dtype {fits[0]}." if fits
                   else "it is no token file of any supported dtype; for a text file set --data.source text.")
            raise ValueError(f"{self.path} is {num_bytes} bytes, not a multiple of the {self.dtype.itemsize}-byte "
                             f"{self.dtype.name} tokens; {fix}")
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
        # Pickling an np.memmap copies the whole file: spawned DataLoader workers reopen it instead.
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        # The last window's target needs one token beyond its input, hence the -1.
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_index(index, len(self))
        start = index * self.seq_len
        # int64 copy: torch indexes embeddings with int64, and the copy detaches from the memmap.
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class TextBytes(TokenFile):
    """A plain text file as byte tokens (vocabulary 256, no tokenizer), windowed like ``TokenFile``."""

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, path: str | os.PathLike, seq_len: int) -> None:
        super().__init__(path, seq_len, dtype="uint8")


def write_token_file(
    path: str | os.PathLike, tokens: np.ndarray | list[int], dtype: str = "uint16"
) -> None:
    """Write ``tokens`` to ``path`` in the ``TokenFile`` format; ``ValueError`` for ids that do not fit ``dtype``."""
    tokens = np.asarray(tokens)
    low, high = _token_id_range(tokens) if tokens.size else (0, 0)
    if low < 0 or high > np.iinfo(dtype).max:
        raise ValueError(f"token id range {low}..{high} does not fit {dtype} (0..{np.iinfo(dtype).max}); ids must "
                         "be >= 0, and larger ones need dtype='int32'.")
    tokens.astype(dtype).ravel().tofile(path)


def _token_id_range(tokens: np.ndarray, chunk_tokens: int = 1 << 22) -> tuple[int, int]:
    """Smallest and largest id in ``tokens`` (not empty), read a chunk at a time so a memmap stays on disk."""
    chunks = (tokens[start : start + chunk_tokens] for start in range(0, len(tokens), chunk_tokens))
    ranges = [(int(chunk.min()), int(chunk.max())) for chunk in chunks]
    return min(low for low, _ in ranges), max(high for _, high in ranges)
