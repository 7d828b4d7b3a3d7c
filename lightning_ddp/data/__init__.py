"""Language-modelling data: four token sources (``sources``) behind one ``LightningDataModule`` with a resumable
sampler (``module``, ``--data.source``). The sources and splits: ``docs/index.md``, "Model, data and other knobs".
"""

from lightning_ddp.data.module import DEFAULT_VOCAB_SIZE, LMDataModule, ResumableDistributedSampler
from lightning_ddp.data.sources import (
    BYTE_VOCAB_SIZE,
    MarkovTokens,
    SyntheticTokens,
    TextBytes,
    TokenFile,
    write_token_file,
)

__all__ = ["BYTE_VOCAB_SIZE", "DEFAULT_VOCAB_SIZE", "LMDataModule", "MarkovTokens", "ResumableDistributedSampler",
           "SyntheticTokens", "TextBytes", "TokenFile", "write_token_file"]
