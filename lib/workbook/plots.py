"""Figures the notebooks show and save. Only this module (and `widgets`) imports matplotlib.

Every figure says what it shows, in what unit, and where the numbers came from (title/caption),
so a PNG found later in `outputs/` still reads on its own.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from workbook.units import GiB, format_bytes


def memory_overview(devices: list[dict], weights_bytes: int | None, caption: str):
    """Horizontal bars: used and free memory per device, and the model's weights as a line.

    `devices`: [{"label", "total_bytes", "free_bytes"}]. Returns the figure.
    """
    figure, axis = plt.subplots(figsize=(8, 0.6 * len(devices) + 1.6))
    labels = [d["label"] for d in devices]
    used = [(d["total_bytes"] - d["free_bytes"]) / GiB for d in devices]
    free = [d["free_bytes"] / GiB for d in devices]
    axis.barh(labels, used, color="#c44e52", label="in use (read now)")
    axis.barh(labels, free, left=used, color="#8fbc8f", label="free (read now)")
    if weights_bytes:
        axis.axvline(weights_bytes / GiB, color="black", linestyle="--",
                     label=f"model weights alone: {format_bytes(weights_bytes)}")
    axis.set_xlabel("GiB")
    axis.invert_yaxis()
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("Memory per device", fontsize=11)
    figure.text(0.01, -0.02, caption, fontsize=7, ha="left", va="top", wrap=True)
    figure.tight_layout()
    return figure
