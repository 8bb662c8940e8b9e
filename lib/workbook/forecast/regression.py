"""The least-squares fits a pilot prices its timings with: no cost below zero (time never falls with
more work, so a negative cost is noise), and the pilot's total time kept::

    intercept, slope = fit_line(tokens, seconds)
    fixed, per_token, per_pair = fit_nonnegative([ones, tokens, pairs], seconds)
"""

from __future__ import annotations

import statistics

import numpy


def fit_line(xs: list[float], ys: list[float], single: str = "slope") -> tuple[float, float]:
    """(intercept, slope) of the least-squares line, neither negative, and always through the
    pilot's total time (the job's batches are spread like the pilot's, so its total is what
    carries over). A single distinct x cannot tell the two apart: ``single`` says which one takes
    the mean ('slope': a line through 0)."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    if len(set(xs)) < 2:
        return (0.0, mean_y / mean_x if mean_x else 0.0) if single == "slope" else (mean_y, 0.0)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    if slope <= 0:  # a negative per-token cost is noise: time never falls with more work
        return mean_y, 0.0
    if mean_y - slope * mean_x < 0:
        # A negative fixed cost is noise too (one slow batch of the longest prompts tilts the line).
        # Clipping it alone would keep the tilted slope and overstate every batch (measured on CPU:
        # the pilot's prefill +27%); through 0, the slope that keeps the pilot's total is the ratio.
        return 0.0, mean_y / mean_x
    return mean_y - slope * mean_x, slope


def fit_nonnegative(columns: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients of ``ys ~ sum_j c_j * columns[j]`` by least squares with every c_j >= 0 (a
    negative cost is noise): the best fit among the subsets of columns whose own least squares is
    nonnegative (a handful of columns: every subset is tried), scaled to keep the pilot's total."""
    target = numpy.asarray(ys, dtype=float)
    best, best_residual = [0.0] * len(columns), float("inf")
    for chosen in range(1, 2 ** len(columns)):
        used = [j for j in range(len(columns)) if chosen >> j & 1]
        design = numpy.asarray([columns[j] for j in used], dtype=float).T
        solution, *_ = numpy.linalg.lstsq(design, target, rcond=None)
        if (solution < 0).any():
            continue
        residual = float(((design @ solution - target) ** 2).sum())
        if residual < best_residual - 1e-15:
            best_residual, best = residual, [0.0] * len(columns)
            for j, value in zip(used, solution):
                best[j] = float(value)
    fitted = sum(c * sum(column) for c, column in zip(best, columns))
    return [c * float(target.sum()) / fitted for c in best] if fitted > 0 else best
