"""The strategy catalogue, and adding an algorithm with no other file: a toy entry registered here runs through the
Lightning strategy, the benchmark sweep's grid, report and plots, and the equivalence matrix.

The toy, ``toy_halves``, is bucketed DDP with its own reduce step: each bucket is all-reduced as two halves (two
collectives) instead of one. It is exact, so it must match single-process training like every engine. It is
registered only for the tests that use it (the ``toy`` fixture, and first thing in each spawned rank), so the
other test modules, which parametrise over the catalogue, see only the package's own algorithms.

A second toy, ``toy_pieces``, has a setting of its own (``pieces``: into how many all-reduces a bucket is split)
and a ``check_settings``: the engine settings are read from its signature, checked when the strategy is built,
reach the engine from YAML (``engine_settings``) on every rank, and become a sweep axis (``grid.engine_settings``).
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch
from torch import nn

from lightning_ddp.sync import BucketedDDP, Communicator, Reduction
from lightning_ddp.sync.bucketed import BucketReduce
from lightning_ddp import catalogue
from lightning_ddp.catalogue import REQUIRED, Entry
from lightning_ddp.reporting import variants
from tests.support.dist_utils import run_on_ranks
from tests.support.equivalence import (
    CASES,
    JOB_TIMEOUT_S,
    check_grad_none_and_record,
    check_matches_single_process,
    check_ranks_agree_and_start_from_rank0,
    data_collectives,
    jobs_for,
    run_jobs,
)
from tests.support.lightning_toy import join_existing_group, tiny_lm_data, tiny_lm_module


class HalvesAllReduce(BucketReduce):
    """SUM all-reduce of each half of the bucket (two collectives), then divide by the world size."""

    def launch(self, comm: Communicator, bucket: torch.Tensor, label: str, layout=None) -> Reduction:
        flat = bucket.view(-1)
        half = flat.numel() // 2
        pending = [comm.all_reduce(flat[:half], f"{label} [first half]"), comm.all_reduce(flat[half:], f"{label} [second half]")]
        return Reduction(comm, pending, bucket, finish=lambda: bucket.div_(comm.world_size))


def halves_engine(module: nn.Module, *, bucket_size_mb=25.0, process_group=None) -> BucketedDDP:
    return BucketedDDP(module, bucket_size_mb=bucket_size_mb, process_group=process_group, reduce=HalvesAllReduce())


TOY = Entry(
    "toy_halves", "Bucketed, each bucket all-reduced as two halves (a test's toy).", engine=halves_engine,
    has_bucket_size=True, overlaps_backward=True, memory="bucketed",
)


def _registered(entry: Entry):
    """``entry`` in the catalogue for one test, then gone (and its Lightning strategy, if someone registered it)."""
    catalogue.register(entry)
    yield entry
    catalogue.STRATEGIES.pop(entry.name, None)
    from lightning.pytorch.strategies import StrategyRegistry

    if entry.name in StrategyRegistry:
        StrategyRegistry.remove(entry.name)


@pytest.fixture
def toy():
    yield from _registered(TOY)


class PiecesAllReduce(BucketReduce):
    """SUM all-reduce of the bucket in ``pieces`` consecutive parts (one collective each), then divide."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces

    def launch(self, comm: Communicator, bucket: torch.Tensor, label: str, layout=None) -> Reduction:
        parts = bucket.view(-1).tensor_split(min(self.pieces, bucket.numel()))
        pending = [comm.all_reduce(part, f"{label} [piece {k + 1}]") for k, part in enumerate(parts)]
        return Reduction(comm, pending, bucket, finish=lambda: bucket.div_(comm.world_size))


class PiecesDDP(BucketedDDP):
    """Bucketed DDP whose buckets are all-reduced in ``pieces`` parts: an engine with a setting of its own."""

    def __init__(self, module: nn.Module, bucket_size_mb=25.0, process_group=None, pieces: int = 2) -> None:
        self.check_settings(pieces)
        super().__init__(module, bucket_size_mb, process_group, reduce=PiecesAllReduce(pieces))

    @staticmethod
    def check_settings(pieces: int) -> None:
        if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
            raise ValueError(f"pieces must be an int >= 1, got {pieces!r}; set e.g. pieces: 2")


PIECES = Entry("toy_pieces", "Bucketed, each bucket all-reduced in `pieces` parts (a test's toy).", engine=PiecesDDP,
               has_bucket_size=True, overlaps_backward=True, memory="bucketed")


@pytest.fixture
def toy_pieces():
    yield from _registered(PIECES)


def test_the_toy_is_registered_with_its_capabilities(toy) -> None:
    assert catalogue.get("toy_halves") is TOY
    assert TOY.has_bucket_size and TOY.exact
    with pytest.raises(ValueError, match="already in the catalogue"):
        catalogue.register(Entry("toy_halves", "another toy", engine=halves_engine))
    with pytest.raises(ValueError, match="toy_halves"):
        catalogue.get("nonexistent")


def test_the_strategy_accepts_the_toy_by_name_and_checks_its_options(toy) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_ddp.strategies import GradSyncStrategy, register_strategies

    register_strategies()  # registered after lightning_ddp.strategies was imported: register again (idempotent)
    assert "toy_halves" in StrategyRegistry and "toy_halves" in catalogue.names(engines_only=True)
    strategy = StrategyRegistry.get("toy_halves")
    assert isinstance(strategy, GradSyncStrategy) and strategy.strategy_name == "toy_halves"
    assert GradSyncStrategy(algorithm="toy_halves", bucket_size_mb=1).bucket_size_mb == 1
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0"):
        GradSyncStrategy(algorithm="toy_halves", bucket_size_mb=-1)
    with pytest.raises(ValueError, match="has no bucket size"):
        GradSyncStrategy(algorithm="naive_ddp", bucket_size_mb=1)


# ---- an engine's own settings ------------------------------------------------------------------------------


def test_settings_are_read_from_the_engine_signature() -> None:
    # Everything beyond module, process_group, bucket_size_mb and reduce, with its default, in signature order.
    assert PIECES.settings() == {"pieces": 2}
    assert catalogue.get("bucketed_powersgd_ddp").settings() == {
        "rank": 4, "start_iter": 10, "min_compression_rate": 2.0, "seed": 0}
    # BucketedDDP's `reduce` is an object the algorithm fixes, not a setting; the others have none.
    assert {name: catalogue.get(name).settings() for name in ("naive_ddp", "flat_ddp", "overlap_ddp", "bucketed_ddp")} \
        == {"naive_ddp": {}, "flat_ddp": {}, "overlap_ddp": {}, "bucketed_ddp": {}}
    # TOY's factory is keyword-only past `module`: still no settings of its own.
    assert TOY.settings() == {}


def test_check_settings_fills_defaults_and_names_the_valid_ones() -> None:
    assert PIECES.check_settings(None) == {"pieces": 2} and PIECES.check_settings({"pieces": 3}) == {"pieces": 3}
    with pytest.raises(ValueError, match=r"'piece' is not a setting of 'toy_pieces'; 'toy_pieces' "
                                         r"takes: pieces=2\."):
        PIECES.check_settings({"piece": 3})
    with pytest.raises(ValueError, match=r"'reduce' is not a setting .*reduce: not an engine setting"):
        PIECES.check_settings({"reduce": None})
    with pytest.raises(ValueError, match=r"'rank' is not a setting of 'bucketed_ddp'; 'bucketed_ddp' has no "
                                         r"engine settings: drop them"):
        catalogue.get("bucketed_ddp").check_settings({"rank": 4})
    with pytest.raises(TypeError, match="must be a mapping of setting names to values.*pieces: 2"):
        PIECES.check_settings([("pieces", 3)])
    # The engine's own check_settings runs with every setting: a bad value fails before any engine exists.
    with pytest.raises(ValueError, match="pieces must be an int >= 1, got 0"):
        PIECES.check_settings({"pieces": 0})
    with pytest.raises(ValueError, match=r"rank \(the PowerSGD approximation rank\) must be >= 1, got 0"):
        catalogue.get("bucketed_powersgd_ddp").check_settings({"rank": 0})


def test_a_required_setting_must_be_given_and_var_keywords_accept_any() -> None:
    def needs_width(module, *, process_group=None, width: int, **extra):
        raise AssertionError("not built in this test")

    algorithm = Entry("toy_required", "needs a width (a test's)", engine=needs_width)
    assert algorithm.settings() == {"width": REQUIRED}  # **extra is not a named setting
    with pytest.raises(ValueError, match=r"needs width in its engine settings; 'toy_required' takes: "
                                         r"width \(required\)"):
        algorithm.check_settings({})
    # A factory with **kwargs takes names we cannot list: they pass through to it.
    assert algorithm.check_settings({"width": 3, "anything": 1}) == {"width": 3, "anything": 1}


def test_the_strategy_checks_engine_settings_when_built(toy_pieces) -> None:
    from lightning_ddp.strategies import GradSyncStrategy, ZeRO1DDPStrategy

    strategy = GradSyncStrategy(algorithm="toy_pieces", engine_settings={"pieces": 3})
    assert strategy.engine_settings == {"pieces": 3}
    assert GradSyncStrategy(algorithm="toy_pieces").engine_settings == {}  # the engine's defaults apply
    with pytest.raises(ValueError, match=r"engine_settings: 'piece' is not a setting of 'toy_pieces'; "
                                         r"'toy_pieces' takes: pieces=2"):
        GradSyncStrategy(algorithm="toy_pieces", engine_settings={"piece": 3})
    with pytest.raises(ValueError, match="engine_settings: pieces must be an int >= 1, got -1"):
        GradSyncStrategy(algorithm="toy_pieces", engine_settings={"pieces": -1})
    with pytest.raises(ValueError, match="engine_settings: 'rank' is not a setting of 'naive_ddp'"):
        GradSyncStrategy(algorithm="naive_ddp", engine_settings={"rank": 4})
    # ZeRO-1 passes them to its grad_sync algorithm, checked against that one.
    assert ZeRO1DDPStrategy(schedule="allreduce_broadcast", grad_sync="toy_pieces",
                            engine_settings={"pieces": 5}).engine_settings == {"pieces": 5}
    with pytest.raises(ValueError, match="engine_settings: 'rank' is not a setting of 'bucketed_ddp'"):
        ZeRO1DDPStrategy(grad_sync="bucketed_ddp", engine_settings={"rank": 4})


def _made_up_analysis(cells):
    """The sweep's analysis of ``cells`` each measured once, one step: 100, 110, ... ms, comm share 0.1, busy 5 ms."""
    from lightning_ddp.bench.report import REPEAT_COLUMNS, Analysis, cell_data, parse_row
    from lightning_ddp.bench.sweep import CellOutcome, repeat_row

    repeats = [parse_row(repeat_row(cell, 0, CellOutcome("ok"), model="tiny", accelerator="cpu", backend="gloo"),
                         REPEAT_COLUMNS) for cell in cells]
    steps = [{"cell_id": cell.id, "repeat": 0, "step": 0, "step/time_ms": 100.0 + 10 * k, "comm/share": 0.1,
              "comm/busy_ms": 5.0} for k, cell in enumerate(cells)]
    return repeats, Analysis(cell_data(repeats, steps))


def test_the_sweep_gives_the_toy_cells_a_bucket_axis_a_report_row_and_plots(toy, tmp_path) -> None:
    from lightning_ddp.bench.config import GridConfig, SweepConfig, expand_grid
    from lightning_ddp.bench.launch import strategy_argument
    from lightning_ddp.bench.report import build_report, write_plots

    config = SweepConfig(grid=GridConfig(strategies=["naive_ddp", "toy_halves"], batch_sizes=[2], context_lengths=[32],
                                         bucket_sizes_mb=[1.0, 4.0]))
    cells = expand_grid(config)
    # reference, naive, toy at 1 and 4 MiB, ddp (always added)
    assert [(c.strategy, c.bucket_size_mb) for c in cells] == [
        ("reference", None), ("naive_ddp", None), ("toy_halves", 1.0), ("toy_halves", 4.0), ("ddp", None)]
    argument = json.loads(strategy_argument(cells[2].strategy, "gloo", cells[2].bucket_size_mb))
    assert argument["init_args"]["algorithm"] == "toy_halves" and argument["init_args"]["bucket_size_mb"] == 1.0

    _, analysis = _made_up_analysis(cells)
    report = build_report(analysis)
    assert "| toy_halves 1 MiB |" in report and "| toy_halves 4 MiB |" in report
    names = {path.name for path in write_plots(tmp_path, analysis)}
    assert names == {"strategies_32-true_bs2.png", "toy_halves_32-true_bs2.png"}



def test_an_engine_setting_is_a_sweep_axis_with_its_own_cells_ids_commands_rows_and_plots(toy_pieces, tmp_path) -> None:
    from lightning_ddp.bench.config import GridConfig, SweepConfig, expand_grid
    from lightning_ddp.bench.sweep import cell_command
    from lightning_ddp.bench.launch import RankLayout
    from lightning_ddp.bench.report import build_report, write_plots

    def config(**settings) -> SweepConfig:
        return SweepConfig(grid=GridConfig(strategies=["toy_pieces"], batch_sizes=[2], context_lengths=[32],
                                           bucket_sizes_mb=[1.0, 4.0], **settings))

    swept = config(engine_settings={"toy_pieces": {"pieces": [2, 3, 3]}})
    cells = expand_grid(swept)
    # reference, the toy at 1 and 4 MiB times pieces 2 and 3 (the repeated 3 counts once), ddp
    assert [(c.strategy, c.bucket_size_mb, dict(c.engine_settings)) for c in cells] == [
        ("reference", None, {}), ("toy_pieces", 1.0, {"pieces": 2}), ("toy_pieces", 1.0, {"pieces": 3}),
        ("toy_pieces", 4.0, {"pieces": 2}), ("toy_pieces", 4.0, {"pieces": 3}), ("ddp", None, {})]
    assert len({c.id for c in cells}) == len(cells)
    assert cells[2].id.startswith("toy_pieces-1mb-pieces3-b2-t32-32-true-")
    assert cells[2].label == "toy_pieces 1 MiB pieces=3 | batch 2 | ctx 32 | 32-true"
    # Without the axis: the toy's cells are new ids (a changed setting reruns), the others keep theirs.
    plain = expand_grid(config())
    assert {c.id for c in plain if c.strategy == "toy_pieces"}.isdisjoint(c.id for c in cells)
    assert [c.id for c in plain if c.strategy != "toy_pieces"] == [c.id for c in cells if c.strategy != "toy_pieces"]

    layout = RankLayout("gloo", 2, 1)

    def strategy_of(cell) -> dict:
        command = cell_command(cell, swept, layout, tmp_path / cell.id)
        return json.loads(command[command.index("--trainer.strategy") + 1])

    assert strategy_of(cells[2])["init_args"] == {"algorithm": "toy_pieces", "process_group_backend": "gloo",
                                                  "bucket_size_mb": 1.0, "engine_settings": {"pieces": 3}}
    assert "engine_settings" not in strategy_of(cells[-1])["init_args"]  # ddp: none to set
    assert "engine_settings" not in strategy_of(plain[1])["init_args"]  # the toy with its defaults: as before

    rows, analysis = _made_up_analysis(cells)  # 100, 110, ... ms
    assert [r["engine_settings"] for r in rows] == ["", "pieces=2", "pieces=3", "pieces=2", "pieces=3", ""]
    report = build_report(analysis)
    for title in ("toy_pieces 1 MiB pieces=2", "toy_pieces 1 MiB pieces=3", "toy_pieces 4 MiB pieces=3"):
        assert f"| {title} |" in report
    # each variant has its own best bucket size (1 MiB: 110 < 130 ms and 120 < 140 ms) and its own goal 1
    assert "| 1. toy_pieces pieces=2 (best) step time / ddp step time | 0.733 [0.733, 0.733] |" in report  # 110 / 150
    assert "| 1. toy_pieces pieces=3 (best) step time / ddp step time | 0.800 [0.800, 0.800] |" in report  # 120 / 150
    names = {path.name for path in write_plots(tmp_path, analysis)}
    assert names == {"strategies_32-true_bs2.png", "toy_pieces-pieces2_32-true_bs2.png",
                     "toy_pieces-pieces3_32-true_bs2.png"}


@pytest.mark.parametrize("settings, match", [
    ({"toy_pieces": {"piece": [2]}}, r"toy_pieces`: 'piece' is not a setting of 'toy_pieces'; 'toy_pieces' takes: pieces"),
    ({"toy_pieces": {"bucket_size_mb": [2]}}, r"bucket_size_mb: not an engine setting; bucket_size_mb has an option of its own"),
    ({"toy_pieces": {"pieces": []}}, r"`grid.engine_settings.toy_pieces`.pieces must be a non-empty list"),
    ({"naive_ddp": {"pieces": [2]}}, r"'pieces' is not a setting of 'naive_ddp'; 'naive_ddp' has no engine settings"),
    ({"bucketed_ddp": {"pieces": [2]}}, r"'pieces' is not a setting of 'bucketed_ddp'"),  # listed or not
    ({"ddp": {"pieces": [2]}}, r"'ddp' is not one of our engines"),
])
def test_an_unknown_engine_setting_is_refused_naming_the_valid_ones(toy_pieces, settings, match) -> None:
    from lightning_ddp.bench.config import GridConfig

    with pytest.raises(ValueError, match=match):
        GridConfig(strategies=["naive_ddp", "toy_pieces"], engine_settings=settings)


# ---- through the equivalence matrix, on 2 ranks ---------------------------------------------------------

TOY_JOBS = jobs_for(["toy_halves"])


def _run_toy_jobs(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict:
    catalogue.register(TOY)  # in this spawned rank: the toy, then the same matrix as every algorithm
    return run_jobs(rank, world_size, jobs)


@pytest.fixture(scope="module")
def toy_ranks() -> list[dict]:
    return run_on_ranks(_run_toy_jobs, 2, TOY_JOBS, timeout=JOB_TIMEOUT_S)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_the_toy_passes_the_equivalence_matrix(toy, toy_ranks, case) -> None:
    check_matches_single_process(toy_ranks, "toy_halves", case)
    check_ranks_agree_and_start_from_rank0(toy_ranks, "toy_halves", case)
    check_grad_none_and_record(toy_ranks, "toy_halves", case)
    # Its own reduce step really ran: every multi-tensor bucket went out as two halves.
    step = toy_ranks[0]["runs"]["toy_halves", case]["steps"][0]
    assert any(c.label.endswith("[second half]") for c in data_collectives(step["collectives"]))


# ---- through Lightning, on 2 ranks --------------------------------------------------------------------


def _fit_with_the_toy_strategy(rank: int, world_size: int) -> dict:
    """A 2-rank Lightning fit with ``trainer.strategy="toy_halves"`` on the process group run_on_ranks made."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_ddp.strategies import register_strategies

    catalogue.register(TOY)  # in this spawned rank: the toy, then its strategy
    register_strategies()
    join_existing_group(rank, world_size)
    data = tiny_lm_data(32)
    module = tiny_lm_module(seed=rank)  # different on each rank: the strategy's broadcast must equalise them
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy="toy_halves", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    engines = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            engines.append(trainer.strategy.model)

    trainer.callbacks.append(Spy())
    trainer.fit(module, DataLoader(data, batch_size=4))
    (engine,) = engines
    return {
        "reduce": type(engine.reduce).__name__,
        "strategy": trainer.strategy.strategy_name,
        "losses": module.losses,
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
    }


@pytest.mark.multiprocess
def test_the_toy_trains_through_the_lightning_strategy() -> None:
    first, second = run_on_ranks(_fit_with_the_toy_strategy, 2, timeout=JOB_TIMEOUT_S)
    assert first["strategy"] == "toy_halves" and first["reduce"] == "HalvesAllReduce"
    assert len(first["losses"]) == 4 and all(torch.isfinite(torch.tensor(first["losses"])))
    for name, value in first["weights"].items():  # the same averaged gradients on both ranks: identical weights
        assert torch.equal(value, second["weights"][name]), name


TOY_PIECES_YAML = textwrap.dedent("""\
    strategy:
      class_path: lightning_ddp.strategies.GradSyncStrategy
      init_args: {algorithm: toy_pieces, bucket_size_mb: null, engine_settings: {pieces: 3}}
""")


def _fit_with_engine_settings_from_yaml(rank: int, world_size: int) -> dict:
    """A 2-rank fit whose strategy jsonargparse builds from ``TOY_PIECES_YAML``, as LightningCLI builds
    ``trainer.strategy`` (its type there is ``str | Strategy``)."""
    import lightning.pytorch as pl
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy
    from torch.utils.data import DataLoader

    catalogue.register(PIECES)  # in this spawned rank
    join_existing_group(rank, world_size)
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=str | Strategy)
    strategy = parser.instantiate_classes(parser.parse_string(TOY_PIECES_YAML)).strategy

    data = tiny_lm_data(16)
    engines = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            engines.append(trainer.strategy.model)

    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Spy()])
    trainer.fit(tiny_lm_module(), DataLoader(data, batch_size=4))
    (engine,) = engines
    return {"engine": type(engine).__name__, "pieces": engine.reduce.pieces, "buckets": len(engine.bucket_indices)}


@pytest.mark.multiprocess
def test_a_toy_setting_reaches_the_engine_on_every_rank_from_yaml() -> None:
    ranks = run_on_ranks(_fit_with_engine_settings_from_yaml, 2, timeout=JOB_TIMEOUT_S)
    # pieces=3 from the YAML, not the engine's default 2, on both ranks; one bucket (bucket_size_mb: null).
    assert ranks == [{"engine": "PiecesDDP", "pieces": 3, "buckets": 1}] * 2


def test_the_catalogue_lists_the_built_ins_in_order() -> None:
    assert catalogue.names() == ["naive_ddp", "flat_ddp", "overlap_ddp", "bucketed_ddp", "bucketed_bf16_ddp",
                                 "bucketed_powersgd_ddp", "zero1_ddp", "zero2_ddp", "fsdp2", "hsdp", "ddp"]
    assert "toy_halves" not in catalogue.STRATEGIES  # registered only while a test uses it


def test_every_entry_is_a_lightning_strategy_of_that_name_with_its_engine() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_ddp.strategies  # noqa: F401 - registers them

    for entry in catalogue.STRATEGIES.values():
        assert entry.name in StrategyRegistry, entry.name
        strategy = StrategyRegistry.get(entry.name)
        assert type(strategy).__name__ == entry.lightning_class.rpartition(".")[2], entry.name
        if entry.is_engine:
            assert strategy.algorithm is entry and strategy.strategy_name == entry.name
        if entry.engine is not None:
            assert callable(entry.engine_factory())


def test_the_strategy_argument_builds_the_entry_through_jsonargparse() -> None:
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    for entry in catalogue.STRATEGIES.values():
        argument = entry.strategy_argument("gloo", settings=None)
        strategy = parser.instantiate_classes(parser.parse_object({"strategy": argument})).strategy
        assert type(strategy).__name__ == entry.lightning_class.rpartition(".")[2], entry.name
    zero2 = catalogue.get("zero2_ddp").strategy_argument("gloo", 4.0, {"collectives": "per_owner"})
    assert zero2["init_args"] == {"process_group_backend": "gloo", "bucket_size_mb": 4.0, "collectives": "per_owner"}
    powersgd = catalogue.get("bucketed_powersgd_ddp").strategy_argument(None, "auto", {"rank": 2})
    assert powersgd["init_args"] == {"algorithm": "bucketed_powersgd_ddp", "bucket_size_mb": "auto",
                                     "engine_settings": {"rank": 2}}


def test_an_entry_names_a_known_memory_model_and_an_identifier() -> None:
    with pytest.raises(ValueError, match="memory model 'huge' is not one of"):
        Entry("toy_memory", "a test's", memory="huge")
    with pytest.raises(ValueError, match="must be a Python identifier"):
        Entry("toy memory", "a test's")


def _table_names(text: str) -> list[str]:
    """The first cell of each markdown table row that is a ``name`` in backticks."""
    return [match.group(1) for match in re.finditer(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M)]


@pytest.mark.parametrize("page", ["README.md", "docs/algorithms.md"])
def test_the_strategy_tables_list_every_catalogue_entry_in_order(page: str) -> None:
    # The tables a user reads to choose: one row per catalogue entry, in catalogue order, nothing else first.
    from tests.support.cli_utils import REPO

    names = _table_names((REPO / page).read_text(encoding="utf-8"))
    assert names[: len(catalogue.STRATEGIES)] == catalogue.names()


def test_how_tables_and_file_names_write_a_strategy_and_its_settings() -> None:
    assert variants.parse_settings("rank=4 min_compression_rate=0.5 mode=fast") == {
        "rank": 4, "min_compression_rate": 0.5, "mode": "fast"}
    assert variants.setting_combinations({"rank": [1, 4], "start_iter": [0]}) == [
        {"rank": 1, "start_iter": 0}, {"rank": 4, "start_iter": 0}]
    assert variants.setting_combinations(None) == [{}]
    assert (variants.variant_label("bucketed_ddp", "auto"), variants.variant_label("bucketed_powersgd_ddp", 4.0,
            "rank=4")) == ("bucketed_ddp auto", "bucketed_powersgd_ddp 4 MiB rank=4")
    assert (variants.format_settings({"rank": 4, "exact": True, "rate": 0.5}), variants.settings_slug({"rank": 4})) \
        == ("rank=4 exact=true rate=0.5", "-rank4")
    assert [variants.format_bucket(v) for v in (25.0, 0.5, "auto", 4)] == ["25", "0.5", "auto", "4"]
