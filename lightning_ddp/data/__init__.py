"""Language-modelling data: four token sources behind one ``LightningDataModule`` (``--data.source``).

``sources``: ``synthetic`` (uniform, sample ``i`` from ``(seed, i)``, nothing to learn), ``markov`` (walks on a seeded
sparse Markov chain, learnable down to ``ln(markov_successors)`` nats), ``tokens`` (a memory-mapped flat file of ids,
nanoGPT's ``train.bin``) and ``text`` (a file's bytes). A sample is a window of ``seq_len + 1`` tokens split into
``x`` and ``y``; files are cut into non-overlapping windows. Held-out splits are streams of their own (generated) or
separate files or tails of the file. ``sampler``: ``ResumableDistributedSampler`` gives rank ``r`` positions
``r, r + world, ...`` of one order shared by every rank, and skips a resumed epoch's trained batches. ``module``:
``LMDataModule``, the ``--data.*`` arguments, their checks, the loaders and the resume state.
"""

from lightning_ddp.data.module import DEFAULT_VOCAB_SIZE, GENERATED_SOURCES, LMDataModule
from lightning_ddp.data.sampler import ResumableDistributedSampler
from lightning_ddp.data.sources import (
    BYTE_VOCAB_SIZE,
    MAX_MARKOV_SUCCESSORS,
    SPLITS,
    TOKEN_DTYPES,
    MarkovTokens,
    SyntheticTokens,
    TextBytes,
    TokenFile,
    write_token_file,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_VOCAB_SIZE",
    "GENERATED_SOURCES",
    "LMDataModule",
    "MAX_MARKOV_SUCCESSORS",
    "MarkovTokens",
    "ResumableDistributedSampler",
    "SPLITS",
    "SyntheticTokens",
    "TOKEN_DTYPES",
    "TextBytes",
    "TokenFile",
    "write_token_file",
]
