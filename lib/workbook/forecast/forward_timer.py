"""Every forward of a model, timed by hooks (synchronized on CUDA so the clock sees the work), with
what the pilot needs to know of it: a static call's attended positions, a stream's tokens."""

from __future__ import annotations

import time
from typing import Callable

from workbook import runtime


def attended_positions(args, kwargs) -> tuple[int]:
    """Positions a forward attends: the new tokens plus what the cache holds (generate drops an
    all-ones mask)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache, mask = kwargs.get("past_key_values"), kwargs.get("attention_mask")
    cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    return ((ids.shape[-1] if ids is not None else 0) + cached if mask is None else mask.shape[-1],)


class ForwardTimer:
    """Times every forward of ``model``: ``events`` holds (start, end, *describe(args, kwargs))."""

    def __init__(self, model, device, clock: Callable[[], float] = time.perf_counter,
                 describe: Callable[[tuple, dict], tuple] = attended_positions):
        self.device, self.clock, self.describe, self.events, self._started = device, clock, describe, [], None
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after)]

    def _before(self, module, args, kwargs):
        described = self.describe(args, kwargs)
        runtime.synchronize(self.device)
        self._started = (self.clock(), described)

    def _after(self, module, args, output):
        runtime.synchronize(self.device)
        self.events.append((self._started[0], self.clock(), *self._started[1]))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
