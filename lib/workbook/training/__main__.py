"""`python -m workbook.training`: the entry point for `accelerate launch` and `torchrun`."""

from workbook.training.cli import main

raise SystemExit(main())
