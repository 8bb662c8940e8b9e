"""`python -m workbook.generation`: the entry point for `accelerate launch` and `torchrun`."""

from workbook.generation.cli import main

raise SystemExit(main())
