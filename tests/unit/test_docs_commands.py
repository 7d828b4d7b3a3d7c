"""Every command and config fragment quoted in README.md and docs/*.md parses; every file they or a link name exists.

A command is a line of a fenced ``bash`` block, a ``$ `` line of a ``console`` block, or an inline
```python -m lightning_ddp...``` span. Each ``python -m lightning_ddp[.x] ARGS`` runs in-process as ``python -m``
runs it, up to the moment its jsonargparse parser has parsed ``ARGS`` (and built the config dataclasses, whose
``__post_init__`` validates them); nothing trains, benchmarks or writes. A ``yaml`` block that is a CLI config is
parsed stacked on the quickstart. Scratch pages ``docs/_from_readme_*`` are skipped.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import jsonargparse
import pytest

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(python -m lightning_ddp[^`]*)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SEPARATORS = {"&&", "||", ";", "|", "&"}
# Paths a command reads: they must exist. Outputs (--out, -o, benchmarks/results/<new>) need not.
INPUT_PREFIXES = ("configs/", "examples/", "docs/", "tests/", "lightning_ddp/")
INPUT_SUFFIXES = (".yaml", ".yml", ".py")
OUTPUT_FLAGS = {"--out", "-o", "--output", "--out_dir", "--output.out_dir", "--archive"}
# Pages other branches write; until they are merged a link to one is the only link allowed to dangle.
PAGES_OF_OTHER_BRANCHES = {"docs/algorithms.md", "docs/comm_timer.md", "docs/benchmarks.md", "docs/projection.md",
                           "docs/gpu.md"}


@dataclass(frozen=True)
class Command:
    page: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {shlex.join(self.words)}"


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once the outermost parse succeeded: stops the entry point there."""


def pages() -> list[Path]:
    """README.md and every docs page but the scratch files awaiting their owner."""
    docs = sorted(path for path in (REPO / "docs").glob("*.md") if not path.name.startswith("_from_readme_"))
    return [REPO / "README.md", *docs]


def _split(text: str) -> list[list[str]]:
    """The simple commands of a shell snippet (comments dropped, ``\\`` continuations joined)."""
    commands: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands.append([])
        for word in lexer:
            if word in SEPARATORS:
                commands.append([])
            else:
                commands[-1].append(word)
    return [words for words in commands if words]


def _expand_loops(commands: list[list[str]]) -> list[list[str]]:
    """``for s in a b; do ... $s ...; done``: the loop's commands once per value, the loop words themselves dropped."""
    expanded: list[list[str]] = []
    loops: list[tuple[str, list[str]]] = []
    for words in commands:
        if words[0] == "for" and len(words) > 2 and words[2] == "in":
            loops.append((words[1], words[3:]))
        elif words == ["done"]:
            loops.pop()
        elif words != ["do"]:
            variants = [words]
            for name, values in loops:
                variants = [[word.replace("$" + name, value) for word in variant]
                            for variant in variants for value in values]
            expanded += variants
    return expanded


def commands_of(text: str, page: str) -> list[Command]:
    """Every command a page quotes, in order."""
    found: list[list[str]] = []
    for match in FENCE.finditer(text):
        language, body = match.group(1), match.group(2)
        if language == "bash":
            found += _expand_loops(_split(body))
        elif language == "console":
            prompts = [line[2:] for line in body.splitlines() if line.startswith("$ ")]
            found += [words for line in prompts for words in _split(line)]
    prose = FENCE.sub("", text)
    found += [words for match in INLINE.finditer(prose) for words in _split(match.group(1).replace("\n", " "))]
    return [Command(page, tuple(words)) for words in found]


def config_fragments() -> list[tuple[str, str]]:
    """``(page, yaml)`` of every fenced ``yaml`` block that is a CLI config (its first key ``trainer``, ``model``,
    ``data``)."""
    return [(path.relative_to(REPO).as_posix(), match.group(2)) for path in pages()
            for match in FENCE.finditer(path.read_text(encoding="utf-8"))
            if match.group(1) == "yaml" and match.group(2).startswith(("trainer:", "model:", "data:"))]


def all_commands() -> list[Command]:
    return [command for path in pages()
            for command in commands_of(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())]


def entry_point(words: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """``(module, arguments)`` of a ``python -m lightning_ddp...`` (also ``torchrun ... -m``); None for others."""
    for index, word in enumerate(words[:-1]):
        module = words[index + 1]
        if word == "-m" and (module == "lightning_ddp" or module.startswith("lightning_ddp.")):
            return module, list(words[index + 2:])
    return None


def named_inputs(words: tuple[str, ...]) -> list[str]:
    """The repository files a command reads (``--config X``, ``configs/...``, ``*.py``), outputs left out."""
    inputs = []
    for index, word in enumerate(words):
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if index > 0 and words[index - 1] in OUTPUT_FLAGS:
            continue
        if "$" in value or value.startswith(("-", "/")) or "://" in value:
            continue
        if value.startswith(INPUT_PREFIXES) or value.endswith(INPUT_SUFFIXES):
            inputs.append(value)
    return inputs


def _check_cli_config(namespace: jsonargparse.Namespace) -> None:
    """What the CLI checks of a parsed config without building it: the strategy's name (a plain string to the parser).

    The CLI's classes (the model, a Trainer) are not built: an xl model takes a minute and gigabytes.
    """
    from lightning_ddp.cli import check_strategy_name

    subcommand = namespace.get("subcommand")
    config = namespace[subcommand] if subcommand else namespace
    check_strategy_name(config.trainer.strategy)


_PARSERS: dict[str, jsonargparse.ArgumentParser] = {}
"""Entry point -> its parser, kept from its first run: building the CLI's parser (the Trainer's, the model's and the
data's signatures) takes seconds, parsing with it milliseconds."""


def parse_entry_point(module: str, arguments: list[str]) -> None:
    """Run ``python -m module arguments`` in-process until its parser has parsed; AssertionError if it refuses.

    The CLI's parser is built once and reused (the study entry points build theirs in milliseconds: each runs).
    """
    original = jsonargparse.ArgumentParser.parse_args
    depth = 0
    cli = module == "lightning_ddp" and arguments[:1] != ["advise"]  # `advise` is the study's own parser

    def parse_and_stop(parser: jsonargparse.ArgumentParser, *args: object, **kwargs: object) -> object:
        nonlocal depth
        depth += 1
        try:
            namespace = original(parser, *args, **kwargs)
        finally:
            depth -= 1
        if depth == 0:
            if cli:
                _PARSERS.setdefault(module, parser)
                _check_cli_config(namespace)
            else:
                parser.instantiate_classes(namespace)  # config dataclasses validate themselves here
            raise _Parsed
        return namespace

    from lightning_ddp.command_line import check_command_line

    stderr = io.StringIO()
    with (mock.patch.object(jsonargparse.ArgumentParser, "parse_args", parse_and_stop),
          mock.patch.object(sys, "argv", ["python -m " + module, *arguments]),
          # a checkpoint a page names (--ckpt_path logs/...) is what the page's fit before it writes
          mock.patch("lightning_ddp.command_line.checkpoint_file", str),
          contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr),
          warnings.catch_warnings()):
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" for a module run as main
        try:
            if cli and module in _PARSERS:
                check_command_line(arguments)  # what `python -m lightning_ddp` checks before parsing
                _PARSERS[module].parse_args(arguments)
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
        except _Parsed:
            return
        except SystemExit as error:
            if not error.code:  # --help, --print_config
                return
            raise AssertionError(f"exit {error.code}: {stderr.getvalue().strip()[-600:]}") from None
        except ValueError as error:
            raise AssertionError(f"ValueError: {error}") from None
    raise AssertionError("the entry point returned without parsing a command line with jsonargparse")


COMMANDS = all_commands()


def test_the_pages_quote_commands_of_every_kind() -> None:
    # The extraction itself must find the quickstart (a bash block), the pre-flight (a console block) and an inline
    # command; an empty list would make every check below pass vacuously.
    modules = {entry_point(command.words)[0] for command in COMMANDS if entry_point(command.words)}
    assert {"lightning_ddp", "lightning_ddp.memory"} <= modules, modules
    assert any(command.page == "README.md" for command in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if entry_point(c.words)], ids=str)
def test_every_quoted_command_parses(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the pages' paths are relative to the repository root
    module, arguments = entry_point(command.words)
    parse_entry_point(module, arguments)


@pytest.mark.parametrize(("page", "fragment"), config_fragments(), ids=lambda value: value.splitlines()[0][:40])
def test_every_quoted_config_fragment_parses_on_the_quickstart(
    page: str, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fragment.yaml").write_text(fragment, encoding="utf-8")
    monkeypatch.chdir(REPO)
    parse_entry_point("lightning_ddp", ["fit", "--config", "configs/quickstart.yaml",
                                        "--config", str(tmp_path / "fragment.yaml")])


@pytest.mark.parametrize("command", [c for c in COMMANDS if named_inputs(c.words)], ids=str)
def test_every_file_a_command_names_exists(command: Command) -> None:
    missing = [name for name in named_inputs(command.words) if not (REPO / name).exists()]
    assert not missing, f"{command} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda path: path.name)
def test_every_local_link_resolves(page: Path) -> None:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    targets = [target for target in LINK.findall(text) if "://" not in target and not target.startswith("mailto:")]
    missing = sorted({(page.parent / target).resolve().relative_to(REPO).as_posix() for target in targets
                      if not (page.parent / target).exists()})
    if missing and set(missing) <= PAGES_OF_OTHER_BRANCHES:
        pytest.skip(f"pages not merged yet: {missing}")
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


# ---- the checker itself ------------------------------------------------------------------------------------------


def test_a_misspelled_option_or_strategy_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    parse_entry_point("lightning_ddp", ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps", "3"])
    with pytest.raises(AssertionError, match="max_stepz"):
        parse_entry_point("lightning_ddp", ["fit", "--config", "configs/quickstart.yaml", "--trainer.max_stepz", "3"])
    with pytest.raises(AssertionError, match="bucketd_ddp"):
        parse_entry_point("lightning_ddp", ["fit", "--config", "configs/quickstart.yaml", "--trainer.strategy",
                                            "bucketd_ddp"])
    parse_entry_point("lightning_ddp.memory", ["--preset", "tiny", "--world_size", "2"])
    with pytest.raises(AssertionError, match="world_sise"):
        parse_entry_point("lightning_ddp.memory", ["--preset", "tiny", "--world_sise", "2"])


def test_a_misspelled_strategy_argument_in_a_fragment_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text("trainer:\n  strategy:\n    class_path: lightning_ddp.strategies.GradSyncStrategy\n"
                        "    init_args: {bucket_size_mbb: 4}\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="bucket_size_mbb"):
        parse_entry_point("lightning_ddp", ["fit", "--config", "configs/quickstart.yaml", "--config", str(fragment)])


def test_a_config_file_that_does_not_exist_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(AssertionError):
        parse_entry_point("lightning_ddp", ["fit", "--config", "configs/no_such_config.yaml"])
    assert named_inputs(("python", "-m", "lightning_ddp", "fit", "--config", "configs/no_such_config.yaml")) == [
        "configs/no_such_config.yaml"]


def test_commands_are_found_in_bash_console_and_inline_quotes() -> None:
    page = "\n".join([
        "Run `python -m lightning_ddp.memory --preset tiny` first.",
        "```bash",
        "pip install -e . && python -m lightning_ddp fit --config configs/quickstart.yaml   # a comment",
        "torchrun --nnodes 2 -m lightning_ddp fit \\",
        "    --trainer.num_nodes 2",
        "```",
        "```console",
        "$ python -m lightning_ddp.trace logs -o out.png",
        "error: printed output, not a command",
        "```",
        "```yaml",
        "trainer: {strategy: ddp}",
        "```",
    ])
    found = [command.words for command in commands_of(page, "page.md")]
    assert found == [
        ("pip", "install", "-e", "."),
        ("python", "-m", "lightning_ddp", "fit", "--config", "configs/quickstart.yaml"),
        ("torchrun", "--nnodes", "2", "-m", "lightning_ddp", "fit", "--trainer.num_nodes", "2"),
        ("python", "-m", "lightning_ddp.trace", "logs", "-o", "out.png"),
        ("python", "-m", "lightning_ddp.memory", "--preset", "tiny"),
    ]
    assert entry_point(found[2]) == ("lightning_ddp", ["fit", "--trainer.num_nodes", "2"])
    assert entry_point(found[0]) is None
    assert named_inputs(found[3]) == []  # -o names an output


def test_the_readme_test_command_is_what_ci_runs() -> None:
    # README's second command and .ci/run install the same torch, the same extra and run the same pytest
    # (CI only adds --quiet to the installs).
    ci = [line.replace(" --quiet", "") for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.startswith("python ")]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    lines = [line for match in FENCE.finditer(readme) if match.group(1) == "bash"
             for line in match.group(2).splitlines() if line.endswith("python -m pytest")]
    assert len(lines) == 1, lines
    assert lines[0].split(" && ") == ci
