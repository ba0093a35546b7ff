"""`python -m bapo_cli ...` (and `torchrun -m bapo_cli train ...`) run the same CLI as `bapo`."""

from bapo_cli.cli import main

if __name__ == "__main__":
    main()
