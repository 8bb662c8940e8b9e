"""GPU experiment workbook: the helpers that the notebooks, the CLI and the tests share."""

__version__ = "0.1.0"

from workbook import launcher_watch as _launcher_watch

# A worker that torchrun, accelerate or the workbook itself started ends with its launcher; watched
# from this first import, not after the seconds torch's import takes (launcher_watch says why).
_launcher_watch.end_with_launcher()
