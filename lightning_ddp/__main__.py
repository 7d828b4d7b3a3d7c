from lightning_ddp.cli import main

if __name__ == "__main__":
    main()
