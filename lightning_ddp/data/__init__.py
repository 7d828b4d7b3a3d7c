"""Language-modelling data: four token sources (``sources``) behind one ``LightningDataModule`` with a resumable
sampler (``module``, ``--data.source``). The sources and splits: ``docs/index.md``, "Model, data and other knobs".
"""

from lightning_ddp.data.module import DEFAULT_VOCAB_SIZE, GENERATED_SOURCES, LMDataModule, ResumableDistributedSampler
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

__all__ = ["BYTE_VOCAB_SIZE", "DEFAULT_VOCAB_SIZE", "GENERATED_SOURCES", "LMDataModule", "MAX_MARKOV_SUCCESSORS",
           "MarkovTokens", "ResumableDistributedSampler", "SPLITS", "SyntheticTokens", "TOKEN_DTYPES", "TextBytes",
           "TokenFile", "write_token_file"]
