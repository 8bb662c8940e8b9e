"""Byte units and their display: binary units (GiB = 2**30 bytes), as nvidia-smi and torch report."""

KiB, MiB, GiB = 2**10, 2**20, 2**30


def binary_unit(count: float) -> tuple[str, int]:
    """The unit that shows `count` bytes with 1 to 3 digits before the point: ('MiB', 2**20), ..."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(count) >= size:
            return unit, size
    return "B", 1


def format_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'; picks the unit that keeps 1 to 3 digits before the point."""
    unit, size = binary_unit(count)
    if size == 1:
        return f"{count:.0f} B"
    return f"{count / size:.{2 if count < 10 * size else 1}f} {unit}"
