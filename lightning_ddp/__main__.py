import sys

if __name__ == "__main__":
    from lightning_ddp.command_line import check_command_line

    check_command_line(sys.argv[1:])  # in milliseconds: a refused input never waits for Lightning's import
    if sys.argv[1:2] == ["advise"]:  # the study's command: imported only here, never by the product
        from lightning_ddp.projection.advise import main as advise

        sys.exit(advise(sys.argv[2:]))
    from lightning_ddp.cli import main

    main()
