"""A benchmark's wall-clock budget (a lent GPU's call is cut at its limit, and a benchmark cut from
outside writes nothing but what it streamed): the benchmark stops itself and writes its report."""

from __future__ import annotations

import _thread
import threading
import time
import traceback


class TimeBudget:
    """A wall-clock budget: ``fits`` says whether a step of some seconds still fits; at the
    deadline, ``KeyboardInterrupt`` is raised in the main thread (``expired`` tells it from Ctrl-C).
    ``points_only``: raised only inside ``measure`` (a benchmark point); elsewhere (a model's build,
    writing a record) the deadline only marks the budget expired, so the next point is not run and the
    report is still written."""

    def __init__(self, seconds: float | None, points_only: bool = False):
        self.deadline = time.monotonic() + seconds if seconds else None
        self.expired, self.timer = False, None
        self.points_only, self.measuring, self.lock = points_only, False, threading.Lock()
        if self.deadline is not None:
            self.timer = threading.Timer(max(seconds, 0), self._expire)
            self.timer.daemon = True
            self.timer.start()

    def _expire(self):
        with self.lock:
            self.expired = True
            if self.measuring or not self.points_only:
                _thread.interrupt_main()

    def fits(self, seconds: float) -> bool:
        return self.deadline is None or time.monotonic() + seconds <= self.deadline

    def check(self):
        """Stop here if the deadline passed (its interrupt may have landed where it was swallowed, e.g. a __del__)."""
        if self.expired:
            raise KeyboardInterrupt

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()

    def measure(self, point: dict, measure) -> dict:
        """``measure()`` (one benchmark point), or ``point`` marked as not run when the budget has run
        out, as stopped when it ran out during the point, or as failed (``error``, the traceback to
        stderr) when it raised: the sweep goes on to its report, and the report says which failed. On a
        lent GPU one broken path (a kernel that never ran there) must not cost every other point."""
        with self.lock:
            if self.expired:
                return {**point, "skipped": "not run: the time budget had run out"}
            self.measuring = True
        try:
            return measure()
        except KeyboardInterrupt:
            if not self.expired:  # Ctrl-C: the user's, not the budget's
                raise
            return {**point, "skipped": "stopped: the time budget ran out during this point"}
        except Exception as error:
            if self.expired:  # the deadline's interrupt, wrapped or raised again by a library
                return {**point, "skipped": "stopped: the time budget ran out during this point"}
            traceback.print_exc()
            text = f"{type(error).__name__}: {error}"[:500]
        finally:
            with self.lock:
                self.measuring = False
        # Out of the except block: its traceback (the point's model and tensors) is gone before the cache clears.
        from accelerate.utils.memory import clear_device_cache  # torch's: only benchmarks get here
        clear_device_cache(garbage_collection=True)
        return {**point, "skipped": f"failed: {text} (the traceback is in the log)", "error": text}


NO_BUDGET = TimeBudget(None)
