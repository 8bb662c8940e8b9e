"""The widget tuner of notebook 01: change the model, GPU profile and settings, see the plan update.

Controls update on release (`continuous_update=False`), not on every pixel of a drag: one plan is
cheap, but redrawing a figure per pixel makes a slider stutter. The figure redraws inside an
Output widget with `clear_output(wait=True)`, which swaps the old image for the new one without a
blank frame. A callback error is shown under the controls instead of vanishing into the log.
"""

from __future__ import annotations

import html
import traceback

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import clear_output, display

from workbook import planning, plots
from workbook.units import format_bytes

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
LORA_RANKS = (0, 4, 8, 16, 32, 64, 128)
CURVE_POINTS = 16


def _labelled(control, label: str, width: str = "360px"):
    control.description = label
    control.style = {"description_width": "150px"}
    control.layout = widgets.Layout(width=width, max_width="100%")
    return control


class PlannerTuner:
    """ipywidgets controls around `planning.plan`; `widget` is what the notebook displays.

    Tests drive it by setting control values (`tuner.batch_size.value = 64`) and reading
    `tuner.plan`, `tuner.verdict.value` and `tuner.figure`.
    """

    def __init__(self, profiles: dict, models: list[str], params: dict):
        self.profiles = profiles
        self.base = dict(params)
        models = list(models) + ([params["model"]] if params["model"] not in models else [])
        mode = params["plan_mode"]
        # 'auto' starts the slider at the planner's answer for the profile's own settings.
        batch = planning.plan(params, mode=mode).batch_size
        self.model = _labelled(widgets.Dropdown(options=models, value=params["model"]), "model")
        self.profile = _labelled(widgets.Dropdown(options=list(profiles), value=params["profile"]), "GPU profile")
        self.dtype = _labelled(widgets.Dropdown(options=WEIGHT_DTYPES, value=params["dtype"]), "weights dtype")
        self.mode = _labelled(widgets.ToggleButtons(options=("generate", "train"), value=mode), "mode")
        self.batch_size = _labelled(widgets.IntSlider(min=1, max=max(1024, 2 * batch), value=batch,
                                                      continuous_update=False), "batch (sequences/GPU)")
        self.prompt_len = _labelled(widgets.BoundedIntText(min=1, max=1_000_000, value=params["prompt_len"]),
                                    "prompt (tokens)")
        self.new_tokens = _labelled(widgets.BoundedIntText(min=1, max=1_000_000, value=params["max_new_tokens"]),
                                    "new tokens")
        self.seq_len = _labelled(widgets.BoundedIntText(min=1, max=1_000_000, value=params["seq_len"]),
                                 "sequence (tokens)")
        self.grad_checkpointing = widgets.Checkbox(value=params["grad_checkpointing"],
                                                   description="gradient checkpointing", indent=False)
        self.lora_rank = _labelled(widgets.Dropdown(options=sorted({*LORA_RANKS, params["lora_rank"]}),
                                                    value=params["lora_rank"]), "LoRA rank (0 = full)")
        self.verdict = widgets.HTML()
        self.max_batch = widgets.HTML()
        self.error = widgets.HTML()
        self.output = widgets.Output(layout=widgets.Layout(min_height="420px"))
        self.plan = None
        self.figure = None
        self.widget = self._layout()
        for control in self._controls():
            control.observe(self._on_change, names="value")
        self.update()

    def _controls(self):
        return (self.model, self.profile, self.dtype, self.mode, self.batch_size, self.prompt_len,
                self.new_tokens, self.seq_len, self.grad_checkpointing, self.lora_rank)

    def _layout(self):
        box = dict(layout=widgets.Layout(border="1px solid #ddd", padding="6px", margin="0 8px 8px 0",
                                         flex="1 1 380px"))
        what = widgets.VBox([widgets.HTML("<b>Model and hardware</b>"), self.model, self.profile, self.dtype,
                             self.mode], **box)
        shape = widgets.VBox([widgets.HTML("<b>Batch and lengths</b>"), self.batch_size, self.prompt_len,
                              self.new_tokens, self.seq_len], **box)
        training = widgets.VBox([widgets.HTML("<b>Training memory savers</b>"), self.grad_checkpointing,
                                 self.lora_rank], **box)
        # flex-wrap: the three groups sit side by side on a wide screen and stack on a laptop.
        controls = widgets.HBox([what, shape, training], layout=widgets.Layout(flex_flow="row wrap"))
        return widgets.VBox([controls, widgets.HBox([self.verdict, self.max_batch]), self.error, self.output])

    def settings(self) -> dict:
        """The planner settings the controls describe (profile facts + control values)."""
        profile = self.profiles[self.profile.value]
        return {**profile, "model": self.model.value, "dtype": self.dtype.value,
                "prompt_len": self.prompt_len.value, "max_new_tokens": self.new_tokens.value,
                "seq_len": self.seq_len.value, "grad_checkpointing": self.grad_checkpointing.value,
                "lora_rank": self.lora_rank.value}

    def _on_change(self, change) -> None:
        self.update()

    def update(self) -> None:
        """Re-plan and redraw; an error is shown in the tuner, the last good figure stays."""
        try:
            settings = self.settings()
            mode = self.mode.value
            self.plan = planning.plan(settings, mode=mode, batch_size=self.batch_size.value)
            self._show_verdict()
            self._redraw(settings, mode)
            self.error.value = ""
        except Exception as error:  # shown to the person at the controls, not swallowed
            self.error.value = (f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(str(error))}\n"
                                f"{html.escape(traceback.format_exc(limit=2))}</pre>")
        for control in (self.prompt_len, self.new_tokens):
            control.disabled = self.mode.value != "generate"
        self.seq_len.disabled = self.grad_checkpointing.disabled = self.lora_rank.disabled = \
            self.mode.value != "train"

    def _show_verdict(self) -> None:
        plan = self.plan
        color, word = ("#1a7f37", "FITS") if plan.fits else ("#b00", "DOES NOT FIT")
        self.verdict.value = (f"<span style='font-size:1.2em;color:{color}'><b>{word}</b></span> "
                              f"{format_bytes(plan.total_bytes)} predicted of "
                              f"{format_bytes(plan.budget_bytes)} budget per GPU&nbsp;&nbsp;")
        self.max_batch.value = f"<span style='font-size:1.2em'>max batch: <b>{plan.max_batch_size}</b></span>"
        if plan.max_batch_size > self.batch_size.max // 2:
            self.batch_size.max = min(max(2 * plan.max_batch_size, 64), 1 << 20)

    def _redraw(self, settings: dict, mode: str) -> None:
        plan = self.plan
        top = max(plan.max_batch_size, plan.batch_size, 1) * 2
        batches = sorted({max(1, round(top * i / CURVE_POINTS)) for i in range(CURVE_POINTS + 1)})
        totals = [planning.plan(settings, mode=mode, batch_size=b).total_bytes for b in batches]
        figure, (bar_axis, curve_axis) = plt.subplots(2, 1, figsize=(9, 6.5), height_ratios=(1, 1.6))
        plots.plan_breakdown(plan, axis=bar_axis)
        plots.memory_vs_batch({f"{settings['model']}, {plan.dtype}": (batches, totals)}, plan.capacity_bytes,
                              plan.budget_bytes, "predicted peak vs batch (the dot is the batch above)",
                              axis=curve_axis)
        curve_axis.plot([plan.batch_size], [plan.total_bytes / 2**30], "o", color="red", markersize=8)
        figure.tight_layout()
        with self.output:
            clear_output(wait=True)
            display(figure)
        plt.close(self.figure) if self.figure is not None else None
        self.figure = figure
        plt.close(figure)  # shown through the Output widget only, not again by the inline backend
