import sys


def run() -> None:
    """``python -m lightning_ddp`` and ``lightning-ddp``: ``advise`` (the study's command, imported only here, never
    by the product) or the CLI; a run that finished exits 0 without finalizing (``lightning_ddp.teardown``)."""
    from lightning_ddp.command_line import check_command_line

    check_command_line(sys.argv[1:])  # in milliseconds: a refused input never waits for Lightning's import
    if sys.argv[1:2] == ["advise"]:
        from lightning_ddp.projection.advise import main as advise

        sys.exit(advise(sys.argv[2:]))
    from lightning_ddp.cli import main
    from lightning_ddp.teardown import exit_without_finalizing

    main()
    exit_without_finalizing()


if __name__ == "__main__":
    run()
