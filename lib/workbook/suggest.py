"""The "did you mean" hint that every unknown-name error (parameter, profile, model) ends with."""
from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """" Did you mean 'x'?" for the closest choices (case ignored), or '' when none is close.

    A name that starts several choices ('a100') names them all; otherwise difflib's closest one.
    """
    by_lower = {choice.lower(): choice for choice in choices}
    name = str(name).lower()
    close = [lower for lower in by_lower if lower.startswith(name)] if name else []
    if not close or len(close) > 3:
        close = difflib.get_close_matches(name, by_lower, n=1, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(f"'{by_lower[lower]}'" for lower in close) + "?"
