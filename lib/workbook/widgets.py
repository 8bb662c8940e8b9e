"""The widget tuner of notebook 01: change the model, GPU profile and settings, see the plan update.

Controls update on release (`continuous_update=False`), not on every pixel of a drag: one plan is
cheap, but redrawing a figure per pixel makes a slider stutter. The figure redraws inside an
Output widget with `clear_output(wait=True)`, which swaps the old image for the new one without a
blank frame, and the Output keeps the figure's height so the page below does not jump while the
new image decodes. A callback error is shown under the verdict instead of vanishing into the log.

Layout: four labelled groups (model and hardware, workload, generation, training) that sit
two by two on a laptop (1024 to 1280 px) and stack on a narrow window; the verdict line right
under them; the two plots side by side so controls, verdict and plot fit on one laptop screen.
`tests/test_browser.py` checks all of this in JupyterLab in a headless browser.

Under the plot a button traces the setting shown (``planner.trace``: the real step on fake tensors,
seconds to a minute): only when clicked, never on a slider move. Its answer (the peak, its phase and
bytes by kind, beside the plan's) stays until the next click, marked once the setting has changed.

The params are read once, at entry, into typed settings (``TunerStart``, ``Hardware`` per profile).
"""

from __future__ import annotations

import html
import traceback
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib.pyplot as plt
from matplotlib.transforms import ScaledTranslation
from IPython.display import clear_output, display

from workbook import plots
from workbook.hardware import Hardware
from workbook.params import default, settings_of
from workbook.planner import fit, profile, trace
from workbook.planner.shape import model_shape
from workbook.units import GiB, format_bytes

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
LORA_RANKS = (0, 4, 8, 16, 32, 64, 128)
LOSS_CHUNKS = (0, 512, 1024, 2048, 4096)  # loss_chunk_tokens choices (0: all logits at once)
CURVE_POINTS = 16
LABEL_WIDTH = "160px"  # wide enough for the longest label with its unit, at JupyterLab's font size
# Two plots side by side, 1000 x 280 px (about 300 with the legend) at the inline backend's 100 dpi: full size at 1280 px,
# scaled to ~80% (still readable) in a 1024 px window; controls, verdict and plot then fit one
# laptop screen (1280 x 800, 1024 x 768) under JupyterLab's menus.
FIGURE_INCHES = (10, 2.8)
FIGURE_MIN_HEIGHT = "300px"  # the figure's height: the page does not jump while an image swaps
# CSS classes: a handle for the browser test and for anyone styling the tuner.
AUTO_LAYOUT = "auto"  # the tensor-parallel size the planner chooses (planner.layout)
TENSOR_PARALLEL_SIZES = [1, 2, 4, 8]  # divisors of an 8-GPU machine
CSS_CLASSES = {"widget": "workbook-tuner", "verdict": "workbook-tuner-verdict",
               "max_batch": "workbook-tuner-max-batch", "advice": "workbook-tuner-advice", "notes": "workbook-tuner-notes",
               "error": "workbook-tuner-error", "output": "workbook-tuner-figure",
               "trace_button": "workbook-tuner-trace-button", "trace_output": "workbook-tuner-trace"}
# Seconds a trace takes per decoder layer, until the tuner has timed one itself: the medians of the committed
# reference table outputs/reference/cpu/trace_vs_plan.json (72 training traces: two steps; 24 generation traces:
# prefill and two decode steps; 0.2 to 4.9 s and 0.07 to 1.9 s per layer on the CPU that made it).
TRACE_SECONDS_PER_LAYER = {"train": 0.9, "generate": 0.2}


@dataclass(frozen=True)
class TunerStart:
    """Where the tuner's controls start: the params keys of the same names (``params.settings_of``)."""

    profile: str = default("profile")
    model: str = default("model")
    dtype: str = default("dtype")
    plan_mode: str = default("plan_mode")
    prompt_len: int = default("prompt_len")
    max_new_tokens: int = default("max_new_tokens")
    tensor_parallel_size: int | str = default("tensor_parallel_size")
    seq_len: int = default("seq_len")
    grad_checkpointing: bool = default("grad_checkpointing")
    lora_rank: int = default("lora_rank")
    loss_chunk_tokens: int = default("loss_chunk_tokens")
    precision: str = default("precision")
    offload_activations: bool = default("offload_activations")


def _labelled(control, label: str, tooltip: str):
    """A control with its label (unit in brackets) in a fixed-width column, filling its group."""
    control.description = label
    control.tooltip = tooltip
    control.style.description_width = LABEL_WIDTH
    control.layout = widgets.Layout(width="100%")
    return control


def _switch(value: bool, label: str, tooltip: str):
    """A checkbox with its label to its right, so two share one line of a group."""
    control = widgets.Checkbox(value=value, description=label, indent=False, layout=widgets.Layout(width="auto"))
    control.tooltip = tooltip
    return control


def _group(title: str, children: list, note: str = ""):
    heading = f"<b>{html.escape(title)}</b>" + (f" <span style='color:#666'>{html.escape(note)}</span>"
                                                 if note else "")
    # flex-basis 360px: two groups per row from ~740 px of notebook width, one below that.
    return widgets.VBox([widgets.HTML(heading, layout=widgets.Layout(height="22px")), *children],
                        layout=widgets.Layout(border="1px solid #ddd", padding="2px 8px", margin="0 8px 6px 0",
                                              flex="1 1 360px", min_width="0"))


def _canonical_model(model: str, models: list[str]) -> str:
    """The listed spelling of `model` ('llama-3.1-8b' -> 'Llama-3.1-8B'), so it is not listed twice."""
    return next((name for name in models if name.lower() == str(model).lower()), str(model))


class PlannerTuner:
    """ipywidgets controls around `planner.profile.plan`; `widget` is what the notebook displays.

    Tests drive it by setting control values (`tuner.batch_size.value = 64`) and reading
    `tuner.plan`, `tuner.verdict.value` and `tuner.figure`; `tuner.trace_button.click()` traces.
    """

    def __init__(self, profiles: dict, models: list[str], params: dict):
        self.profiles = profiles
        self.hardware = {name: Hardware.from_params(values) for name, values in profiles.items()}
        start = settings_of(TunerStart, params)
        models = list(models)
        model = _canonical_model(start.model, models)
        models += [model] if model not in models else []
        mode = start.plan_mode
        # A batch per mode, as in the params (batch_size, micro_batch_size): a generation batch of
        # hundreds means nothing for a training step. 'auto' starts at the planner's answer.
        self._batch_by_mode = {m: profile.plan(params, mode=m).batch_size for m in ("generate", "train")}
        self._quiet = False  # True while the tuner itself moves a control: one update, not two
        batch = self._batch_by_mode[mode]
        self.model = _labelled(widgets.Dropdown(options=models, value=model), "model",
                               "a preset or a local model directory (its config.json only; nothing is loaded)")
        self.profile = _labelled(widgets.Dropdown(options=list(profiles), value=start.profile), "GPU profile",
                                 "params/<profile>.yaml: GPU memory, count, safety margin, CUDA overhead")
        self.dtype = _labelled(widgets.Dropdown(options=WEIGHT_DTYPES, value=start.dtype), "weights dtype",
                               "bytes per weight: fp32 4, bf16/fp16 2, int8 1, int4 0.5")
        self.mode = _labelled(widgets.ToggleButtons(options=("generate", "train"), value=mode), "mode",
                              "plan generation (KV cache) or a training step (gradients, optimizer)")
        self.mode.style.button_width = "90px"
        # ipywidgets 8 puts a ToggleButtons' label above its buttons; inline, it lines up with the others.
        self.mode.add_class("widget-inline-hbox")
        self.batch_size = _labelled(widgets.IntSlider(min=1, max=max(64, 2 * batch), value=batch,
                                                      continuous_update=False), "batch (seqs/GPU)",
                                    "sequences per GPU (the micro-batch when training); click the number to type one")
        self.prompt_len = _labelled(widgets.BoundedIntText(min=1, max=1_000_000, value=start.prompt_len),
                                    "prompt (tokens)", "prompt tokens per sequence (use your data's longest)")
        self.new_tokens = _labelled(widgets.BoundedIntText(min=1, max=1_000_000, value=start.max_new_tokens),
                                    "new (tokens)", "tokens generated per sequence; the KV cache grows with them")
        sizes = [AUTO_LAYOUT, *TENSOR_PARALLEL_SIZES]
        size = start.tensor_parallel_size
        self.tensor_parallel = _labelled(widgets.Dropdown(options=sizes + ([size] if size not in sizes else []),
                                                          value=size), "tensor parallel",
                                         "GPUs one copy of the model is sharded over (T; the profile's other GPUs "
                                         "run copies, D); auto: the smallest T that fits a useful batch")
        self.seq_len = _labelled(widgets.BoundedIntText(min=1, max=1_000_000, value=start.seq_len),
                                 "sequence (tokens)", "training sequence length; activations grow with it")
        self.grad_checkpointing = _switch(start.grad_checkpointing, "gradient checkpointing",
                                          "recompute activations in backward: ~1 layer of activations, "
                                          "~30% more compute")
        self.lora_rank = _labelled(widgets.Dropdown(options=sorted({*LORA_RANKS, start.lora_rank}),
                                                    value=start.lora_rank), "LoRA rank",
                                   "0: full fine-tune; > 0: train LoRA adapters only, on a frozen base")
        self.loss_chunk_tokens = _labelled(
            widgets.Dropdown(options=sorted({*LOSS_CHUNKS, start.loss_chunk_tokens}),
                             value=start.loss_chunk_tokens), "loss chunk (tokens)",
            "0: all logits at once; N: the loss over chunks of N positions (same loss, less memory)")
        self.precision = _labelled(widgets.Dropdown(options=["mixed", "bf16"], value=start.precision),
                                   "precision", "mixed: autocast over fp32 master weights; bf16: pure bf16 "
                                   "weights and AdamW states (needs weights dtype bf16)")
        self.offload_activations = _switch(start.offload_activations, "offload activations",
                                           "saved activations in host memory: about one layer's on the GPU, "
                                           "PCIe copies every step")
        self.verdict = widgets.HTML()
        self.max_batch = widgets.HTML()
        self.advice = widgets.HTML()
        self.notes = widgets.HTML()  # the plan's notes, under the plot: their number changes with the setting
        self.error = widgets.HTML(layout=widgets.Layout(display="none"))  # shown only when there is one
        self.output = widgets.Output(layout=widgets.Layout(min_height=FIGURE_MIN_HEIGHT))
        self.trace_button = widgets.Button(layout=widgets.Layout(width="auto"), icon="search",
                                           tooltip="run this setting's step on fake tensors (no GPU, no weights) and "
                                                   "show its peak beside the plan; a slider move traces nothing")
        self.trace_output = widgets.HTML()
        self.trace_button.on_click(self.trace)
        self.traced: dict | None = None  # the last trace's block (trace.traced_plan), None before the first click
        self._traced_setting = None  # what it traced: (settings, mode, batch)
        self._seconds_per_layer = dict(TRACE_SECONDS_PER_LAYER)  # replaced by the tuner's own timing per mode
        for name, css_class in CSS_CLASSES.items():
            if name != "widget":
                getattr(self, name).add_class(css_class)
        self.plan = None
        self.figure = None
        self.widget = self._layout()
        self.widget.add_class(CSS_CLASSES["widget"])
        for control in self._controls():
            control.observe(self._on_change, names="value")
        self.update()

    def _controls(self):
        return (self.model, self.profile, self.dtype, self.mode, self.batch_size, self.tensor_parallel,
                self.prompt_len, self.new_tokens, self.seq_len, self.grad_checkpointing, self.lora_rank,
                self.loss_chunk_tokens, self.precision, self.offload_activations)

    def _layout(self):
        groups = [
            _group("Model and hardware", [self.model, self.profile, self.dtype]),
            _group("Workload", [self.mode, self.batch_size, self.lora_rank]),
            _group("Generation", [self.tensor_parallel, self.prompt_len, self.new_tokens], "(mode generate)"),
            _group("Training", [self.seq_len, self.loss_chunk_tokens, self.precision,
                                widgets.HBox([self.grad_checkpointing, self.offload_activations])], "(mode train)"),
        ]
        controls = widgets.HBox(groups, layout=widgets.Layout(flex_flow="row wrap"))
        result = widgets.HBox([self.verdict, self.max_batch],
                              layout=widgets.Layout(flex_flow="row wrap", align_items="baseline"))
        return widgets.VBox([controls, result, self.advice, self.error, self.output, self.notes, self.trace_button,
                             self.trace_output])

    def settings(self) -> dict:
        """The planner settings the controls describe (profile facts + control values)."""
        facts = self.profiles[self.profile.value]
        return {**facts, "model": self.model.value, "dtype": self.dtype.value,
                "prompt_len": self.prompt_len.value, "max_new_tokens": self.new_tokens.value,
                "seq_len": self.seq_len.value, "grad_checkpointing": self.grad_checkpointing.value,
                "lora_rank": self.lora_rank.value, "tensor_parallel_size": self.tensor_parallel.value,
                "loss_chunk_tokens": self.loss_chunk_tokens.value, "precision": self.precision.value,
                "offload_activations": self.offload_activations.value}

    def _on_change(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.mode:
            self._batch_by_mode[change["old"]] = self.batch_size.value
            batch = self._batch_by_mode[change["new"]]
            self._quiet = True
            try:
                self.batch_size.max = max(self.batch_size.max, batch)
                self.batch_size.value = batch
            finally:
                self._quiet = False
        self.update()

    def update(self) -> None:
        """Re-plan and redraw; an error is shown in the tuner, the last good figure stays."""
        try:
            settings = self.settings()
            mode = self.mode.value
            self.plan = profile.plan(settings, mode=mode, batch_size=self.batch_size.value)
            self._show_verdict()
            self._redraw(settings, mode)
            self._show_trace_state()
            self.error.value = ""
            self.error.layout.display = "none"
        except Exception as error:  # shown to the person at the controls, not swallowed
            # The verdict above would otherwise still describe the previous settings.
            self.verdict.value = ("<span style='font-size:1.2em;color:#b00'><b>NOT UPDATED</b></span> "
                                  "the planner failed for these settings (below); the plot shows the last good plan")
            self.max_batch.value = self.advice.value = self.notes.value = ""
            self.error.value = (f"<pre style='color:#b00;white-space:pre-wrap;margin:0'>"
                                f"{html.escape(type(error).__name__)}: {html.escape(str(error))}\n"
                                f"{html.escape(traceback.format_exc(limit=2))}</pre>")
            self.error.layout.display = None
        for control in (self.tensor_parallel, self.prompt_len, self.new_tokens):
            control.disabled = self.mode.value != "generate"
        for control in (self.seq_len, self.grad_checkpointing, self.lora_rank, self.loss_chunk_tokens, self.precision,
                        self.offload_activations):
            control.disabled = self.mode.value != "train"

    def _show_verdict(self) -> None:
        plan = self.plan
        per = " per GPU" if self._on_gpu() else ""  # the cpu profile plans this machine's RAM
        color, word = ("#1a7f37", "FITS") if plan.fits else ("#b00", "DOES NOT FIT")
        self.verdict.value = (f"<span style='font-size:1.2em;color:{color}'><b>{word}</b></span> "
                              f"batch {plan.batch_size} ({plan.mode}): {format_bytes(plan.total_bytes)} predicted of "
                              f"{format_bytes(plan.budget_bytes)} budget{per}&nbsp;&nbsp;")
        layout = (f" &nbsp;layout: <b>T={plan.tensor_parallel_size} x D={plan.data_parallel_size}</b>"
                  if plan.mode == "generate" else "")
        self.max_batch.value = f"<span style='font-size:1.2em'>max batch: <b>{plan.max_batch_size}</b>{layout}</span>"
        # Always one line (the spare memory when it fits), so the plot below does not jump when the
        # verdict flips.
        spare = f"{format_bytes(plan.budget_bytes - plan.total_bytes)} of the budget left{per}."
        advice = [plan.advice() or spare]
        if plan.mode == "train" and not plan.fits:
            advice += fit.ways_to_fit_lines(fit.ways_to_fit(self.settings(), batch_size=plan.batch_size))
        self.advice.value = _grey_lines(advice)
        # The plan's notes (its layout, the moment of its peak, what it cannot run) go under the plot,
        # so a setting with more of them does not push the plot off a laptop's screen.
        self.notes.value = _grey_lines(plan.notes)
        # The slider spans twice the largest batch that fits (as the curve does), so the interesting
        # part is not squeezed into a few pixels; never below the batch it shows.
        self.batch_size.max = min(max(2 * plan.max_batch_size, 64, self.batch_size.value), 1 << 20)

    def _redraw(self, settings: dict, mode: str) -> None:
        plan = self.plan
        top = max(plan.max_batch_size, plan.batch_size, 1) * 2
        batches = sorted({max(1, round(top * i / CURVE_POINTS)) for i in range(CURVE_POINTS + 1)})
        totals = [profile.plan(settings, mode=mode, batch_size=b).total_bytes for b in batches]
        figure, (bar_axis, curve_axis) = plt.subplots(1, 2, figsize=FIGURE_INCHES, width_ratios=(1, 1.15),
                                                      layout="constrained")
        on_gpu = self._on_gpu()
        plots.plan_breakdown(plan, axis=bar_axis, on_gpu=on_gpu)
        # Half a figure wide, the bar has no room for the legend beside it: legend under, a shorter title.
        # Its gap below the axis is in points (tick labels + x label), not a fraction of the axis height.
        under_the_label = bar_axis.transAxes + ScaledTranslation(0, -32 / 72, figure.dpi_scale_trans)
        bar_axis.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=under_the_label, ncol=2,
                        fontsize=7, frameon=False)
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        bar_axis.set_title(f"{mode}, {plan.dtype}, batch {plan.batch_size}: {format_bytes(plan.total_bytes)}, "
                           f"{verdict}", fontsize=9.5, color="black" if plan.fits else "#b00")
        bar_axis.set_xlabel(f"GiB{' per GPU' if on_gpu else ''} (predicted from the model config)", fontsize=8.5)
        plots.memory_vs_batch({f"{self.model.value}, {plan.dtype}": (batches, totals)}, plan.capacity_bytes,
                              plan.budget_bytes, f"predicted peak vs batch (red dot: batch {plan.batch_size}, "
                                                 f"max {plan.max_batch_size})", axis=curve_axis, on_gpu=on_gpu)
        curve_axis.plot([plan.batch_size], [plan.total_bytes / GiB], "o", color="red", markersize=8)
        with self.output:
            clear_output(wait=True)
            display(figure)
        plt.close(self.figure) if self.figure is not None else None
        self.figure = figure
        plt.close(figure)  # shown through the Output widget only, not again by the inline backend

    def _on_gpu(self) -> bool:
        return self.hardware[self.profile.value].has_gpu

    def _setting(self) -> tuple:
        return (tuple(sorted(self.settings().items(), key=lambda item: item[0])), self.mode.value,
                self.batch_size.value)

    def _trace_seconds(self) -> float:
        """About how long tracing the setting shown takes: seconds per decoder layer (the tuner's last trace of
        this mode, else the reference) x layers."""
        return self._seconds_per_layer[self.mode.value] * model_shape(self.model.value).num_layers

    def _show_trace_state(self) -> None:
        """The button's label for the setting shown, and the last trace marked when it is of another setting."""
        self.trace_button.description = f"Trace this setting (fake tensors, ~{max(1, round(self._trace_seconds()))} s)"
        if self.traced is not None and self._traced_setting != self._setting():
            self.trace_output.value = self._trace_html(stale=True)

    def trace(self, _button=None) -> None:
        """Trace the setting shown (the button's handler): the peak, its phase and bytes by kind, beside the
        plan. What cannot be traced (int4, FSDP, tensor parallel, ...) is said, and the plan still stands."""
        if self.plan is None or self.error.value:
            self.trace_output.value = ("<pre style='color:#b00;margin:0'>nothing traced: the planner failed for these "
                                       "settings (above)</pre>")
            return
        label = self.trace_button.description
        self.trace_button.disabled, self.trace_button.description = True, "Tracing (fake tensors) ..."
        try:
            setting, plan = self._setting(), self.plan
            self.traced = trace.traced_plan(self.settings(), plan)
            self._traced_setting = setting
            if "seconds" in self.traced:
                layers = model_shape(self.model.value).num_layers
                self._seconds_per_layer[plan.mode] = self.traced["seconds"] / layers
            self.trace_output.value = self._trace_html(stale=False)
        except Exception as error:  # shown beside the button, as a failed update is
            self.traced, self._traced_setting = None, None
            self.trace_output.value = (f"<pre style='color:#b00;white-space:pre-wrap;margin:0'>trace failed: "
                                       f"{html.escape(type(error).__name__)}: {html.escape(str(error))}</pre>")
        finally:
            self.trace_button.disabled = False
            self.trace_button.description = label
            self._show_trace_state()

    def _trace_html(self, stale: bool) -> str:
        lines = trace.traced_plan_lines(self.traced)
        if stale:
            lines.insert(0, "this trace is of an earlier setting: click the button to trace the one shown")
        color = "#888" if stale else "#222"
        return (f"<pre style='color:{color};white-space:pre-wrap;margin:0;font-size:0.9em'>"
                f"{html.escape(chr(10).join(lines))}</pre>")


def _grey_lines(lines: list[str]) -> str:
    return "<br>".join(f"<span style='color:#555'>{html.escape(line)}</span>" for line in lines)
