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

Held-out splits, for validation (``validate``, and during ``fit``) and ``test``:

- generated sources: ``--data.val_samples`` and ``--data.test_samples`` samples (256 each by default), each
  split a stream of its own drawn from the same seed (``synthetic``: generator seeds hashed from
  ``(seed, split, i)``; ``markov``: other walks on the same chain). They never repeat a training sample and do
  not change with ``--data.num_samples``.
- files: a separate file (``--data.val_path``, ``--data.test_path``), or held-out tails of ``--data.path``: its
  windows are cut ``[train | val | test]`` by ``--data.val_fraction`` and ``--data.test_fraction`` (0 by default:
  no split), and the held-out windows are removed from the training set.

Each rank evaluates its own shard of a split (samples ``r, r + world, ...``, in order); the loss is averaged
over all of them (``LitGPT``).

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

=============  ====================================================================================
module         what it holds
=============  ====================================================================================
``sources``    the token sources, each a ``Dataset`` of ``(x, y)`` windows: ``SyntheticTokens``,
               ``MarkovTokens``, ``TokenFile``, ``TextBytes``; ``write_token_file``
``sampler``    ``ResumableDistributedSampler``: rank-disjoint indices that can skip a resumed epoch's start
``module``     ``LMDataModule``: the ``--data.*`` arguments, their checks, the loaders, the resume state
=============  ====================================================================================

Every name is importable from ``lightning_ddp.data`` itself (``from lightning_ddp.data import LMDataModule``).
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
from lightning_ddp.data.sources import _token_id_range  # noqa: F401 - private, but the tests import it from here

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
