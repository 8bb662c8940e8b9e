"""GPU experiment workbook: the helpers that the notebooks, the CLI and the tests share."""

__version__ = "0.1.0"
