"""Tests for lightning_ddp.data: datasets, windowing, rank sharding and input errors."""

from __future__ import annotations

import math
import pickle
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_ddp.data import (
    LMDataModule,
    MarkovTokens,
    ResumableDistributedSampler,
    SyntheticTokens,
    TextBytes,
    TokenFile,
    write_token_file,
)
from lightning_ddp.data.sources import _token_id_range


def _batches(loader, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


# ---- synthetic ---------------------------------------------------------------------------------


def test_synthetic_same_seed_gives_same_samples_and_batches():
    kwargs = dict(vocab_size=50, seq_len=8, num_samples=64, batch_size=4)
    first, second = LMDataModule(seed=3, **kwargs), LMDataModule(seed=3, **kwargs)
    first.setup("fit")
    second.setup("fit")
    for i in (0, 17, 63):
        assert all(torch.equal(a, b) for a, b in zip(first.train_dataset[i], second.train_dataset[i]))
    # Shuffled batches too: the loader's generator is seeded from --data.seed.
    for (x1, y1), (x2, y2) in zip(_batches(first.train_dataloader(), 5), _batches(second.train_dataloader(), 5)):
        assert x1.shape == (4, 8) and x1.dtype == torch.int64
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_synthetic_different_seed_gives_different_samples():
    x0, _ = SyntheticTokens(10, seq_len=32, vocab_size=1000, seed=0)[5]
    x1, _ = SyntheticTokens(10, seq_len=32, vocab_size=1000, seed=1)[5]
    # 32 uniform draws out of 1000 agreeing by chance: probability 1e-96.
    assert not torch.equal(x0, x1)


def test_synthetic_sample_does_not_depend_on_access_order():
    dataset = SyntheticTokens(20, seq_len=16, vocab_size=100, seed=7)
    forward = [dataset[i][0] for i in range(20)]
    backward = [dataset[i][0] for i in reversed(range(20))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    # A fresh dataset (another rank, another worker) reproduces sample 13 alone.
    assert torch.equal(SyntheticTokens(20, 16, 100, seed=7)[13][0], forward[13])


def test_synthetic_tokens_are_in_vocab_and_y_is_x_shifted():
    dataset = SyntheticTokens(50, seq_len=64, vocab_size=7, seed=0)
    for i in range(len(dataset)):
        x, y = dataset[i]
        assert x.shape == y.shape == (64,)
        assert 0 <= int(x.min()) and int(x.max()) < 7
        assert torch.equal(x[1:], y[:-1])


# ---- markov ------------------------------------------------------------------------------------


def _transitions(dataset: MarkovTokens, samples: range) -> list[tuple[int, int]]:
    """Every (token, next token) pair of the given samples."""
    return [pair for i in samples for pair in zip(*(t.tolist() for t in dataset[i]))]


def test_markov_sample_depends_only_on_seed_and_index():
    dataset = MarkovTokens(50, seq_len=32, vocab_size=1000, seed=4)
    forward = [dataset[i][0] for i in range(50)]
    backward = [dataset[i][0] for i in reversed(range(50))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    # A fresh dataset (another rank) and a pickled one (a spawned DataLoader worker) rebuild sample 13 alone.
    assert torch.equal(MarkovTokens(50, 32, 1000, seed=4)[13][0], forward[13])
    assert torch.equal(pickle.loads(pickle.dumps(dataset))[13][0], forward[13])
    with pytest.raises(IndexError):
        dataset[50]


def test_markov_tokens_are_in_vocab_and_y_is_x_shifted():
    dataset = MarkovTokens(50, seq_len=64, vocab_size=7, seed=0, successors=3)
    for i in range(len(dataset)):
        x, y = dataset[i]
        assert x.shape == y.shape == (64,) and x.dtype == y.dtype == torch.int64
        assert 0 <= int(x.min()) and int(x.max()) < 7 and int(y.max()) < 7
        assert torch.equal(x[1:], y[:-1])


def test_markov_different_seeds_give_different_chains_and_samples():
    first, second = MarkovTokens(10, 32, 1000, seed=0), MarkovTokens(10, 32, 1000, seed=1)
    # Two random tables of 1000 x 4 successors agreeing everywhere by chance: impossible in practice.
    assert not np.array_equal(first.next_tokens, second.next_tokens)
    assert not torch.equal(first[5][0], second[5][0])
    # Negative seeds work too (mapped to 2**64 + seed) and differ from their absolute value.
    assert not torch.equal(MarkovTokens(10, 32, 1000, seed=-1)[5][0], MarkovTokens(10, 32, 1000, seed=1)[5][0])


def test_markov_walks_only_take_the_chains_k_distinct_successors():
    dataset = MarkovTokens(300, seq_len=128, vocab_size=10_000, seed=0, successors=4)
    assert dataset.next_tokens.shape == (10_000, 4)
    assert all(len(set(row)) == 4 for row in dataset.next_tokens.tolist())  # distinct: the floor is ln 4 exactly
    seen = defaultdict(set)
    for token, following in _transitions(dataset, range(300)):
        seen[token].add(following)
    # Every observed successor is in the table, so no token has more than 4. Uniform tokens would give the
    # frequent tokens hundreds of different successors: here the structure a model can learn is plain.
    assert all(following <= set(dataset.next_tokens[token].tolist()) for token, following in seen.items())
    assert max(len(following) for following in seen.values()) == 4


def test_markov_successors_are_equally_likely_so_the_floor_is_ln_k():
    dataset = MarkovTokens(300, seq_len=128, vocab_size=10_000, seed=0, successors=4)
    transitions = _transitions(dataset, range(300))  # 38,400 transitions
    by_token = defaultdict(Counter)
    for token, following in transitions:
        by_token[token][following] += 1
    # The most frequent token is followed ~1,000+ times; each of its 4 successors should take 1/4 of those
    # (a binomial spread of sqrt(n/4 * 3/4) ~ 3 % of n/4 at n = 1,000, so +-20 % is a > 6-sigma band).
    counts = max(by_token.values(), key=lambda c: sum(c.values()))
    total = sum(counts.values())
    assert total > 500 and len(counts) == 4
    assert all(0.8 * total / 4 < n < 1.2 * total / 4 for n in counts.values()), counts
    # Empirical conditional entropy H(next | token), weighted by how often each token occurs: close to ln 4 = 1.386
    # (slightly below: tokens seen only a few times show fewer than 4 successors).
    entropy = -sum(
        n / len(transitions) * math.log(n / sum(c.values())) for c in by_token.values() for n in c.values()
    )
    assert 1.2 < entropy <= math.log(4) + 1e-9, entropy


def test_markov_frequencies_are_skewed_so_a_few_tokens_carry_most_of_the_text():
    dataset = MarkovTokens(300, seq_len=128, vocab_size=10_000, seed=0)
    counts = Counter(token for i in range(300) for token in dataset[i][1].tolist())
    # Zipf weights: the stationary walk puts ~3/4 of its tokens on 100 of the 10,000 (measured 73-76 % for seeds
    # 0 and 1). Uniform data would put 1 % there. That skew is what makes the loss fall within tens of steps.
    top_100 = sum(n for _, n in counts.most_common(100)) / sum(counts.values())
    assert top_100 > 0.6, top_100


def test_markov_through_the_data_module():
    kwargs = dict(source="markov", vocab_size=500, seq_len=16, num_samples=64, batch_size=4, markov_successors=2)
    first, second = LMDataModule(seed=3, **kwargs), LMDataModule(seed=3, **kwargs)
    assert isinstance(first.train_dataset, MarkovTokens) and first.train_dataset.successors == 2
    first.setup("fit")
    second.setup("fit")
    for (x1, y1), (x2, y2) in zip(_batches(first.train_dataloader(), 5), _batches(second.train_dataloader(), 5)):
        assert x1.shape == (4, 16)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert first.vocab_size == 500


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        (dict(markov_successors=0), r"--data\.markov_successors is 0; set it between 1 and 64"),
        (dict(markov_successors=65), r"--data\.markov_successors is 65; set it between 1 and 64"),
        (dict(markov_successors=8, vocab_size=5), r"--data\.markov_successors is 8; set it between 1 and 5"),
        (dict(path="train.bin"), r"--data\.source is markov, which reads no file"),
    ],
)
def test_markov_bad_arguments(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        LMDataModule(source="markov", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        (dict(source="wikitext"), r"--data\.source 'wikitext' is not supported; choose synthetic, markov, tokens"),
        (dict(token_dtype="int7"), r"--data\.token_dtype 'int7' is not supported; choose one of uint16, int32"),
    ],
)
def test_an_unknown_source_or_token_dtype_is_refused_from_python_too(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        LMDataModule(**kwargs)


# ---- rank-disjointness -------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_get_disjoint_samples(shuffle):
    # The train loader carries a ResumableDistributedSampler (a DistributedSampler, so Lightning keeps it). Every
    # rank uses the same seed, so all ranks agree on one permutation and rank r takes positions r, r + 2, ...
    module = LMDataModule(vocab_size=100, seq_len=4, num_samples=64, shuffle=shuffle)
    module.setup("fit")
    assert isinstance(module.train_dataloader().sampler, DistributedSampler)
    shards = [
        set(ResumableDistributedSampler(module.train_dataset, num_replicas=2, rank=rank, shuffle=shuffle, seed=0))
        for rank in (0, 1)
    ]
    assert len(shards[0]) == len(shards[1]) == 32  # 64 samples over 2 ranks, none repeated
    assert shards[0].isdisjoint(shards[1])
    assert shards[0] | shards[1] == set(range(64))


def test_uneven_dataset_drops_the_tail_instead_of_repeating_samples():
    # 65 samples over 2 ranks: 32 each, one sample left out; a padded sampler would give some rank a duplicate.
    dataset = SyntheticTokens(num_samples=65, seq_len=4, vocab_size=100)
    shards = [list(ResumableDistributedSampler(dataset, 2, rank, shuffle=True, seed=0)) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 32
    assert set(shards[0]).isdisjoint(shards[1])


def test_skip_resumes_the_same_permutation_and_only_in_its_epoch():
    dataset = SyntheticTokens(num_samples=40, seq_len=4, vocab_size=100)
    full = ResumableDistributedSampler(dataset, 2, 1, shuffle=True, seed=3)
    resumed = ResumableDistributedSampler(dataset, 2, 1, shuffle=True, seed=3)
    resumed.skip(epoch=0, samples=6)
    assert list(resumed) == list(full)[6:]  # epoch 0: the 6 samples already trained on are left out
    assert len(resumed) == len(full) == 20  # the epoch's length does not change (Lightning counts on it)
    full.set_epoch(1)
    resumed.set_epoch(1)
    assert list(resumed) == list(full)  # epoch 1: untouched


def test_epoch_source_overrides_set_epoch():
    # Lightning may call set_epoch(1) while the trainer is still in epoch 0 after a resume; the trainer wins.
    dataset = SyntheticTokens(num_samples=40, seq_len=4, vocab_size=100)
    reference = ResumableDistributedSampler(dataset, 2, 0, shuffle=True, seed=0)
    sampler = ResumableDistributedSampler(dataset, 2, 0, shuffle=True, seed=0, epoch_source=lambda: 0)
    sampler.set_epoch(1)
    assert list(sampler) == list(reference)


def test_data_module_state_round_trip_skips_trained_batches():
    module = LMDataModule(vocab_size=100, seq_len=4, num_samples=64, batch_size=4, shuffle=True)
    module.setup("fit")
    full = [x for x, _ in module.train_dataloader()]
    module.load_state_dict({"epoch": 0, "batches_done": 3})  # what a checkpoint after 3 batches records
    resumed = [x for x, _ in module.train_dataloader()]
    assert len(resumed) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[3:]))


# ---- token and text files ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_token_file_round_trip_windows(tmp_path, dtype):
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(11), dtype=dtype)
    dataset = TokenFile(path, seq_len=3, dtype=dtype)
    # 11 tokens hold (11 - 1) // 3 = 3 windows of 4 tokens starting at 0, 3, 6 (token 10 unused).
    assert len(dataset) == 3
    x, y = dataset[1]
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6]
    x, y = dataset[2]
    assert x.tolist() == [6, 7, 8] and y.tolist() == [7, 8, 9]
    assert x.dtype == y.dtype == torch.int64
    with pytest.raises(IndexError):
        dataset[3]


def test_token_file_reads_ids_above_int16(tmp_path):
    # GPT-2 ids reach 50,256: uint16 must read them unsigned, int32 beyond 65,535.
    path = tmp_path / "big.bin"
    write_token_file(path, [50_256, 65_535, 1], dtype="uint16")
    assert TokenFile(path, seq_len=2)[0][0].tolist() == [50_256, 65_535]
    write_token_file(path, [100_000, 7, 1], dtype="int32")
    assert TokenFile(path, seq_len=2, dtype="int32")[0][0].tolist() == [100_000, 7]


def test_text_bytes_gives_byte_values(tmp_path):
    path = tmp_path / "input.txt"
    path.write_bytes(b"hello world")
    dataset = TextBytes(path, seq_len=5)
    # 11 bytes hold (11 - 1) // 5 = 2 windows: "hello " and " world".
    assert len(dataset) == 2
    x, y = dataset[0]
    assert bytes(x.tolist()) == b"hello" and bytes(y.tolist()) == b"ello "
    assert bytes(dataset[1][1].tolist()) == b"world"
    module = LMDataModule(source="text", path=str(path), seq_len=5, batch_size=1)
    assert module.vocab_size == 256


def test_token_source_through_the_data_module(tmp_path):
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(41) % 13)
    module = LMDataModule(source="tokens", path=str(path), vocab_size=13, seq_len=4, batch_size=2, shuffle=False)
    module.setup("fit")
    x, y = next(iter(module.train_dataloader()))
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert module.val_dataloader() == []  # no validation configured


def test_token_id_range_scans_in_chunks():
    tokens = np.array([5, 3, 9, 0, 4, 2, 8], dtype=np.int32)
    # Chunks of 3 split the array as [5, 3, 9] [0, 4, 2] [8]: min and max come from different chunks.
    assert _token_id_range(tokens, chunk_tokens=3) == (0, 9)


# ---- validation split --------------------------------------------------------------------------


def test_val_fraction_holds_out_the_last_windows(tmp_path):
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(201))  # (201 - 1) // 4 = 50 windows
    module = LMDataModule(source="tokens", path=str(path), vocab_size=201, seq_len=4, val_fraction=0.1)
    module.setup("fit")
    # ceil(50 * 0.1) = 5 windows held out: the last 5, starting at tokens 180, 184, ..., 196.
    assert len(module.train_dataset) == 45 and len(module.val_dataset) == 5
    train_starts = {int(module.train_dataset[i][0][0]) for i in range(45)}
    val_starts = {int(module.val_dataset[i][0][0]) for i in range(5)}
    assert val_starts == {180, 184, 188, 192, 196}
    assert train_starts.isdisjoint(val_starts)
    val_batches = list(module.val_dataloader())
    assert sum(len(x) for x, _ in val_batches) == 5  # validation keeps the partial last batch


def test_val_path_gives_a_separate_validation_set(tmp_path):
    write_token_file(tmp_path / "train.bin", np.arange(41))
    write_token_file(tmp_path / "val.bin", np.arange(100, 121))
    module = LMDataModule(
        source="tokens", path=str(tmp_path / "train.bin"), val_path=str(tmp_path / "val.bin"),
        vocab_size=200, seq_len=4,
    )
    module.setup("fit")
    assert len(module.train_dataset) == 10 and len(module.val_dataset) == 5
    assert module.val_dataset[0][0].tolist() == [100, 101, 102, 103]


# ---- input errors: each says the cause and the fix ---------------------------------------------


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError, match=r"nope\.bin.*does not exist.*set --data\.path"):
        LMDataModule(source="tokens", path=missing)
    with pytest.raises(ValueError, match="set --data.path"):
        LMDataModule(source="tokens")


def test_token_id_not_below_vocab_size(tmp_path):
    path = tmp_path / "train.bin"
    write_token_file(path, [1, 2, 10_000, 3, 4])
    # Checked when the module is built, before the Trainer starts: no process launched, no log written.
    with pytest.raises(ValueError, match=r"token id 10000.*set --data\.vocab_size to at least 10001"):
        LMDataModule(source="tokens", path=str(path), seq_len=2, batch_size=1)  # vocab 10,000


def test_file_shorter_than_one_sequence(tmp_path):
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(8))
    # One sample needs seq_len + 1 = 9 tokens: 8 inputs and the target after the last.
    with pytest.raises(ValueError, match=r"has 8 tokens but one sample needs seq_len \+ 1 = 9"):
        LMDataModule(source="tokens", path=str(path), seq_len=8)


def test_seq_len_longer_than_context_length():
    with pytest.raises(ValueError, match=r"--data\.seq_len 256 exceeds.*--model\.context_length"):
        LMDataModule(seq_len=256, context_length=128)
    LMDataModule(seq_len=128, context_length=128)  # equal is fine


def test_text_source_with_another_vocab_size(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("some text " * 100)
    with pytest.raises(ValueError, match=r"vocabulary is 256, but --data\.vocab_size is 1000"):
        LMDataModule(source="text", path=str(path), vocab_size=1000)
    assert LMDataModule(source="text", path=str(path), vocab_size=256).vocab_size == 256


def test_file_size_not_a_multiple_of_the_dtype(tmp_path):
    path = tmp_path / "train.bin"
    # 11 uint16 tokens = 22 bytes: a multiple of 2 but not of 4, so int32 cannot be right.
    write_token_file(path, np.arange(11), dtype="uint16")
    with pytest.raises(ValueError, match=r"22 bytes, not a multiple.*set --data\.token_dtype uint16"):
        LMDataModule(source="tokens", path=str(path), token_dtype="int32", seq_len=2, batch_size=1)


def test_too_few_samples_for_one_batch():
    module = LMDataModule(num_samples=3, batch_size=4)
    with pytest.raises(ValueError, match=r"fewer than one batch.*--data\.batch_size"):
        module.setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        (dict(batch_size=0), r"set --data\.batch_size to at least 1"),
        (dict(seq_len=0), r"set --data\.seq_len to at least 1"),
        (dict(val_fraction=1.0), r"must be in \[0, 1\)"),
        (dict(path="train.bin"), r"--data\.source is synthetic"),
    ],
)
def test_bad_arguments(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        LMDataModule(**kwargs)


def test_write_token_file_refuses_ids_that_do_not_fit(tmp_path):
    # uint16 holds 0..65,535; writing 70,000 would silently wrap to 4,464 without this check.
    with pytest.raises(ValueError, match="does not fit uint16.*dtype='int32'"):
        write_token_file(tmp_path / "x.bin", [70_000])


# ---- held-out splits of the generated sources ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["synthetic", "markov"])
def test_generated_held_out_splits_are_disjoint_sized_and_deterministic(source):
    kwargs = dict(source=source, vocab_size=1000, seq_len=16, num_samples=64, val_samples=24, test_samples=16)
    module = LMDataModule(seed=5, **kwargs)
    assert (len(module.train_dataset), len(module.val_dataset), len(module.test_dataset)) == (64, 24, 16)

    def windows(dataset) -> set[tuple[int, ...]]:
        return {tuple(dataset[i][0].tolist()) for i in range(len(dataset))}

    train, val, test = windows(module.train_dataset), windows(module.val_dataset), windows(module.test_dataset)
    # Every sample is distinct (16 tokens out of 1000 agreeing by chance: never), so 104 distinct windows in all:
    # no held-out sample repeats a training sample or one of the other split.
    assert len(train) == 64 and len(val) == 24 and len(test) == 16
    assert train.isdisjoint(val) and train.isdisjoint(test) and val.isdisjoint(test)
    # The same seed rebuilds the same splits; another seed gives other ones.
    again = LMDataModule(seed=5, **kwargs)
    assert windows(again.val_dataset) == val and windows(again.test_dataset) == test
    assert windows(LMDataModule(seed=6, **kwargs).val_dataset).isdisjoint(val)
    # A split is its own stream: it does not move when the training set grows.
    bigger = LMDataModule(seed=5, **{**kwargs, "num_samples": 1000})
    assert windows(bigger.val_dataset) == val


def test_markov_held_out_splits_walk_the_training_chain():
    module = LMDataModule(source="markov", vocab_size=500, seq_len=64, num_samples=8, val_samples=8, seed=2)
    train, val = module.train_dataset, module.val_dataset
    assert val.next_tokens is train.next_tokens  # shared, not rebuilt: the same distribution to evaluate on
    # Every transition of a validation walk is one of the chain's 4 successors of its token.
    for token, following in _transitions(val, range(8)):
        assert following in train.next_tokens[token]


def test_held_out_split_of_a_dataset_refuses_train():
    with pytest.raises(ValueError, match="'val' or 'test', not 'train'"):
        SyntheticTokens(8, 4, 10).held_out("train", 4)
    with pytest.raises(ValueError, match="split 'dev' is not one of train, val, test"):
        SyntheticTokens(8, 4, 10, split="dev")


def test_generated_sources_take_sample_counts_not_fractions():
    with pytest.raises(ValueError, match=r"--data\.val_fraction is for files.*set --data\.val_samples instead"):
        LMDataModule(source="markov", val_fraction=0.1)
    with pytest.raises(ValueError, match=r"set --data\.test_samples to at least 0"):
        LMDataModule(test_samples=-1)


# ---- held-out splits of files ----------------------------------------------------------------------------------


def test_val_and_test_fractions_cut_train_val_test_tails(tmp_path):
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(201))  # (201 - 1) // 4 = 50 windows, window i starts at token 4 i
    module = LMDataModule(source="tokens", path=str(path), vocab_size=201, seq_len=4, val_fraction=0.1,
                          test_fraction=0.2)
    # ceil(50 * 0.2) = 10 test windows at the very end (40..49), ceil(50 * 0.1) = 5 val windows before them
    # (35..39), 35 for training (0..34).
    starts = {name: [int(getattr(module, f"{name}_dataset")[i][0][0]) for i in range(n)]
              for name, n in (("train", 35), ("val", 5), ("test", 10))}
    assert (len(module.train_dataset), len(module.val_dataset), len(module.test_dataset)) == (35, 5, 10)
    assert starts["train"] == [4 * i for i in range(35)]
    assert starts["val"] == [4 * i for i in range(35, 40)]
    assert starts["test"] == [4 * i for i in range(40, 50)]


def test_test_path_gives_a_separate_test_set(tmp_path):
    write_token_file(tmp_path / "train.bin", np.arange(41))
    write_token_file(tmp_path / "test.bin", np.arange(100, 113))
    module = LMDataModule(source="tokens", path=str(tmp_path / "train.bin"), test_path=str(tmp_path / "test.bin"),
                          vocab_size=200, seq_len=4)
    # The whole training file trains; (13 - 1) // 4 = 3 test windows from the other file, no validation split.
    assert len(module.train_dataset) == 10 and len(module.test_dataset) == 3 and module.val_dataset is None
    assert module.test_dataset[0][0].tolist() == [100, 101, 102, 103]


def test_fractions_that_leave_no_training_window(tmp_path):
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(21))  # 5 windows: ceil(5 * 0.5) + ceil(5 * 0.5) = 6 held out
    with pytest.raises(ValueError, match=r"of 5 samples leave none for training"):
        LMDataModule(source="tokens", path=str(path), vocab_size=21, seq_len=4, val_fraction=0.5, test_fraction=0.5)


# ---- evaluating: the split must exist, and every rank gets its own shard -----------------------------------------


class _FakeTrainer:
    """What the data module reads of a Trainer: the world size and this rank."""

    def __init__(self, world_size: int, global_rank: int = 0) -> None:
        self.world_size, self.global_rank = world_size, global_rank


@pytest.mark.parametrize(("stage", "kwargs", "phrase"), [
    ("validate", dict(val_samples=0), r"`validate` needs a val split.*set --data\.val_samples above 0"),
    ("test", dict(test_samples=0), r"`test` needs a test split.*set --data\.test_samples above 0"),
])
def test_evaluating_without_a_split_says_which_flag_adds_one(stage, kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        LMDataModule(**kwargs).setup(stage)
    LMDataModule(**kwargs).setup("fit")  # fit only skips validation


def test_validating_a_file_without_a_split_names_both_ways(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("some text " * 100)
    with pytest.raises(ValueError, match=r"set --data\.val_fraction .* or --data\.val_path"):
        LMDataModule(source="text", path=str(path)).setup("validate")


def test_a_split_smaller_than_the_world_is_refused():
    module = LMDataModule(val_samples=1)
    module.trainer = _FakeTrainer(world_size=2)
    # One sample over 2 ranks leaves rank 1 none: it would not join the epoch-end all-reduce of the loss.
    with pytest.raises(ValueError, match=r"val split has 1 samples, fewer than the 2 ranks.*raise --data\.val_samples to at least 2"):
        module.setup("validate")


def test_eval_loaders_shard_the_split_over_ranks_in_order_without_repeats():
    # 11 validation samples over 2 ranks, batches of 2: rank 0 evaluates 0, 2, 4, 6, 8 and rank 1 1, 3, 5, 7, 9;
    # sample 10 is left out so both run 3 batches (Lightning's own sampler would repeat sample 0 on rank 1).
    module = LMDataModule(vocab_size=100, seq_len=4, num_samples=8, val_samples=11, batch_size=2)
    shards = []
    for rank in (0, 1):
        module.trainer = _FakeTrainer(world_size=2, global_rank=rank)
        loader = module.val_dataloader()
        assert isinstance(loader.sampler, DistributedSampler)  # Lightning keeps it, injects none
        assert len(loader) == 3
        shards.append(list(loader.sampler))
    assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    module.trainer = None
    assert [len(x) for x, _ in module.test_dataloader()] == [2] * 128  # one process: all 256 test samples
