"""The command line's shared pieces: the parser every `workbook` subcommand and launch entry point
uses, and `--set key=value`. Imports nothing of the workbook, so any entry point can use it."""

from __future__ import annotations

import argparse
import textwrap


def keys_help(keys: tuple[str, ...], schema: dict, width: int = 100) -> str:
    """The params keys a job reads, one per line with its meaning and accepted values (``schema``:
    ``params.SCHEMA``)."""
    lines = ["parameters this job reads (from the params file; change any with --set key=value):"]
    name_width = max(len(key) for key in keys) + 2
    for key in keys:
        spec = schema[key]
        plain_string = spec.kind is str and not spec.choices and not spec.int_list
        text = spec.meaning + ("" if plain_string else f" [{spec.expected()}]")
        lines += textwrap.wrap(text, width, initial_indent="  " + key.ljust(name_width),
                               subsequent_indent=" " * (name_width + 2), break_on_hyphens=False)
    return "\n".join(lines)


class WorkbookParser(argparse.ArgumentParser):
    """argparse's parser; a job's (``keys`` and ``schema`` given) lists the params keys it reads in its --help."""

    def __init__(self, *args, keys: tuple[str, ...] = (), schema: dict | None = None, **kwargs):
        if keys:
            kwargs["formatter_class"] = argparse.RawDescriptionHelpFormatter  # keep the key table's lines
        super().__init__(*args, **kwargs)
        self.keys, self.schema = keys, schema

    def format_help(self) -> str:
        if self.keys and self.epilog is None:
            self.epilog = keys_help(self.keys, self.schema)
        return super().format_help()


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """`--set key=value ...`, repeatable: every --set adds to the overrides (`extend`), none replaces another."""
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override parameters, validated like the file: --set dtype=fp16 batch_size=8; "
                             "may be repeated (every --set counts)")
