"""The widget tuner of notebook 01, used the way a person uses it: in JupyterLab, in a browser.

The test starts JupyterLab (127.0.0.1, a free port, a random token) on a parameterized copy of
`notebooks/01_memory_planning.ipynb` (profile h200, model llama-3.1-8b, `interactive = True`),
opens it in headless Debian Chromium through Playwright, runs all cells from the Run menu, then
types a batch size into the slider, presses arrow keys, picks another model, switches to train
mode and ticks gradient checkpointing, reading the verdict and the max batch as rendered and
comparing screenshots of the plot before and after (and watching every frame for a flicker).
Last, the layout at 1280 x 800 and 1024 x 768: no clipped labels, controls and plot on one screen.

Run alone: `pytest -m browser` (about 45 s on 2 cores). Screenshots: the test's temporary
folder, copied to `outputs/browser-test/` to look at. Needs /usr/bin/chromium (`make test`
installs it); skipped with the reason where it is missing.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from browser_helpers import (CHROMIUM, CHROMIUM_FLAGS, STOP_WATCHING_JS, WATCH_FIGURE_JS, chromium_missing_reason,
                             parameterized_notebook, start_jupyterlab, stop_jupyterlab)
from workbook.paths import NOTEBOOKS_DIR, OUTPUTS_DIR

pytestmark = pytest.mark.browser

_missing = chromium_missing_reason()
if _missing:
    pytest.skip(f"browser test skipped: {_missing}", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

NOTEBOOK = NOTEBOOKS_DIR / "01_memory_planning.ipynb"
# On h200 the planner's largest generate batch for llama-3.1-8b is ~345: a batch the slider
# reaches, so one more flips the verdict; Llama-3.2-1B fits several times more.
PROFILE, MODEL, SMALLER_MODEL = "h200", "llama-3.1-8b", "Llama-3.2-1B"
LAPTOP = {"width": 1280, "height": 800}
SCREENSHOTS_FOR_PEOPLE = OUTPUTS_DIR / "browser-test"
KERNEL_IDLE = "Python 3 (ipykernel) | Idle"
NOTEBOOK_SECONDS = 120  # running all cells (about 15 s here); generous for a loaded CI machine
UPDATE_SECONDS = 30  # one tuner update (re-plan + redraw) takes well under a second


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    """The test's screenshot folder; afterwards (pass or fail) copied to outputs/browser-test/."""
    folder = tmp_path_factory.mktemp("browser-test")
    yield folder
    shutil.rmtree(SCREENSHOTS_FOR_PEOPLE, ignore_errors=True)
    shutil.copytree(folder, SCREENSHOTS_FOR_PEOPLE)


@pytest.fixture(scope="module")
def lab_folder(tmp_path_factory) -> Path:
    """What JupyterLab serves: notebook 01 with h200, llama-3.1-8b and `interactive = True` injected
    (the committed notebook keeps its cpu defaults); the run writes into run/ beside it."""
    folder = tmp_path_factory.mktemp("lab")
    parameterized_notebook(NOTEBOOK, folder, PROFILE, folder / "run", model=MODEL, interactive=True)
    return folder


@pytest.fixture(scope="module")
def jupyterlab(lab_folder, tmp_path_factory):
    lab = start_jupyterlab(lab_folder, tmp_path_factory.mktemp("jupyter-state"))
    try:
        yield lab
    finally:
        stop_jupyterlab(lab)


@pytest.fixture(scope="module")
def page(tmp_path_factory, jupyterlab):
    """A Chromium tab with a fresh profile (no history, no background connections)."""
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
            args=list(CHROMIUM_FLAGS), headless=True, viewport=LAPTOP)
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


class Tuner:
    """The rendered tuner: its parts found by label and class, values read as text on screen."""

    def __init__(self, page):
        self.page = page
        self.root = page.locator(".workbook-tuner")
        self.verdict = self.root.locator(".workbook-tuner-verdict")
        self.max_batch_text = self.root.locator(".workbook-tuner-max-batch")
        self.error = self.root.locator(".workbook-tuner-error")
        self.figure = self.root.locator(".workbook-tuner-figure")
        self.image = self.figure.locator("img")
        self.batch_slider = self.root.locator(".widget-hslider").filter(has_text="batch")

    def max_batch(self) -> int:
        return int(re.search(r"max batch: (\d+)", self.max_batch_text.inner_text()).group(1))

    def batch(self) -> int:
        return int(self.batch_slider.locator(".widget-readout").inner_text())

    def figure_screenshot(self, path: Path) -> bytes:
        self.figure.scroll_into_view_if_needed()
        return self.figure.screenshot(path=path)

    def redraw(self, action) -> dict:
        """Do `action` (a person's input), wait for the new figure; returns what the flicker probe saw."""
        old_source = self.image.get_attribute("src")
        self.figure.evaluate(WATCH_FIGURE_JS)
        action()
        expect(self.image).not_to_have_attribute("src", old_source, timeout=UPDATE_SECONDS * 1000)
        self.page.wait_for_function("(image) => image.complete && image.naturalHeight > 0",
                                    arg=self.image.element_handle(), timeout=UPDATE_SECONDS * 1000)
        self.page.wait_for_timeout(300)  # a few more frames for the probe
        return self.figure.evaluate(STOP_WATCHING_JS)


@pytest.fixture(scope="module")
def tuner(page, jupyterlab, screenshots):
    """The notebook opened in JupyterLab and run from the Run menu, as a person would."""
    started = time.monotonic()
    tuner = Tuner(page)
    try:
        page.goto(jupyterlab.lab_url(NOTEBOOK.name))
        expect(page.get_by_text(KERNEL_IDLE)).to_be_visible(timeout=60_000)
        # Close the file browser: a laptop user gives the notebook the width.
        page.locator(".jp-SideBar .lm-TabBar-tab[data-id='filebrowser']").click()
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        expect(tuner.image).to_be_visible(timeout=NOTEBOOK_SECONDS * 1000)
        expect(page.get_by_text(KERNEL_IDLE)).to_be_visible(timeout=NOTEBOOK_SECONDS * 1000)
    except Exception:
        page.screenshot(path=screenshots / "00-failed-to-show-the-tuner.png")
        print("JupyterLab's log, last lines:\n" + jupyterlab.log_tail())
        raise
    tuner.root.evaluate("(element) => element.scrollIntoView({block: 'start'})")
    page.screenshot(path=screenshots / "01-tuner-after-run-all-1280.png")
    print(f"notebook opened and run in {time.monotonic() - started:.1f} s")
    tracebacks = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
    assert tracebacks.count() == 0, "a cell failed:\n" + "\n".join(tracebacks.all_inner_texts())
    return tuner


def test_typing_a_batch_beyond_the_maximum_flips_the_verdict_and_redraws(tuner, screenshots):
    expect(tuner.verdict).to_contain_text("FITS")
    maximum = tuner.max_batch()
    assert tuner.batch() == maximum > 32, "'auto' should start the slider at the planner's largest batch"
    before = tuner.figure_screenshot(screenshots / "02-figure-at-max-batch.png")

    def type_one_more():
        # The slider's number is editable: click it, replace the text, Enter.
        readout = tuner.batch_slider.locator(".widget-readout")
        readout.click()
        tuner.page.keyboard.press("Control+A")
        tuner.page.keyboard.type(str(maximum + 1))
        tuner.page.keyboard.press("Enter")

    seen = tuner.redraw(type_one_more)
    expect(tuner.verdict).to_contain_text("DOES NOT FIT")
    expect(tuner.verdict).to_contain_text(f"batch {maximum + 1}")
    assert tuner.max_batch() == maximum and tuner.batch() == maximum + 1
    after = tuner.figure_screenshot(screenshots / "03-figure-one-past-max.png")
    assert after != before, "the plot did not change when the batch went past the maximum"
    assert seen["frames"] > 0 and seen["framesWithoutImage"] == 0, f"the plot flickered: {seen}"
    figure_height = tuner.figure.bounding_box()["height"]
    assert seen["minHeight"] >= figure_height - 2, f"the page jumped while the plot redrew: {seen}"
    tuner.root.evaluate("(element) => element.scrollIntoView({block: 'start'})")
    tuner.page.screenshot(path=screenshots / "04-does-not-fit-1280.png")

    # The keyboard on the slider's handle: one step left is the maximum again.
    seen = tuner.redraw(lambda: (tuner.batch_slider.locator(".noUi-handle").focus(),
                                 tuner.page.keyboard.press("ArrowLeft")))
    expect(tuner.verdict).to_contain_text("FITS")
    expect(tuner.verdict).not_to_contain_text("DOES NOT FIT")
    assert tuner.batch() == maximum
    assert seen["framesWithoutImage"] == 0, f"the plot flickered: {seen}"
    expect(tuner.error).to_have_text("")


def test_choosing_a_smaller_model_raises_the_max_batch_and_redraws(tuner, screenshots):
    maximum = tuner.max_batch()
    before = tuner.figure_screenshot(screenshots / "05-figure-before-model-change.png")
    model = tuner.root.get_by_label("model", exact=True)
    seen = tuner.redraw(lambda: model.select_option(SMALLER_MODEL))
    expect(tuner.max_batch_text).not_to_have_text(f"max batch: {maximum}")
    assert tuner.max_batch() > 2 * maximum, "a 1B model should fit several times the 8B model's batch"
    expect(tuner.verdict).to_contain_text("FITS")
    after = tuner.figure_screenshot(screenshots / "06-figure-after-model-change.png")
    assert after != before, "the plot did not change with the model"
    assert seen["framesWithoutImage"] == 0, f"the plot flickered: {seen}"
    expect(tuner.error).to_have_text("")


def test_train_mode_enables_the_training_controls_and_checkpointing_raises_the_max_batch(tuner, screenshots):
    prompt = tuner.root.get_by_label("prompt (tokens)", exact=True)
    sequence = tuner.root.get_by_label("sequence (tokens)", exact=True)
    checkpointing = tuner.root.get_by_label("gradient checkpointing")
    expect(sequence).to_be_disabled()
    generate_batch = tuner.batch()
    tuner.redraw(lambda: tuner.root.get_by_role("button", name="train", exact=True).click())
    expect(tuner.verdict).to_contain_text("(train)")
    expect(sequence).to_be_enabled()
    expect(checkpointing).to_be_enabled()
    expect(prompt).to_be_disabled()
    # Training has its own micro-batch (the params' micro_batch_size), not the generation batch.
    assert tuner.batch() != generate_batch
    without = tuner.max_batch()
    tuner.redraw(lambda: checkpointing.click())
    expect(tuner.max_batch_text).not_to_have_text(f"max batch: {without}")
    assert tuner.max_batch() > without, "gradient checkpointing should let a larger micro-batch fit"
    expect(tuner.verdict).to_contain_text("DOES NOT FIT" if tuner.batch() > tuner.max_batch() else "FITS")
    tuner.root.evaluate("(element) => element.scrollIntoView({block: 'start'})")
    tuner.page.screenshot(path=screenshots / "07-train-with-checkpointing-1280.png")
    expect(tuner.error).to_have_text("")


@pytest.mark.parametrize("width, height", [(1280, 800), (1024, 768)])
def test_the_tuner_reads_well_on_a_laptop_screen(tuner, screenshots, width, height):
    page = tuner.page
    page.set_viewport_size({"width": width, "height": height})
    tuner.root.evaluate("(element) => element.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)  # the notebook re-lays out after the resize
    page.screenshot(path=screenshots / f"08-tuner-{width}x{height}.png")
    layout = tuner.root.evaluate("""(root) => {
      const box = (element) => element.getBoundingClientRect();
      const labels = [...root.querySelectorAll('label.widget-label')].filter((l) => l.offsetWidth > 0);
      return {
        overflow: root.scrollWidth - root.clientWidth,
        clipped: labels.filter((l) => l.scrollWidth > l.clientWidth).map((l) => l.textContent),
        labels: labels.map((l) => l.textContent),
        groupTops: [...root.querySelectorAll('.widget-vbox > .widget-html:first-child')]
                     .map((heading) => Math.round(box(heading).top)),
        image: box(root.querySelector('.workbook-tuner-figure img')).toJSON(),
        rootRight: box(root).right,
        visibleBottom: box(root.closest('.jp-WindowedPanel-outer') || root.closest('.jp-Notebook')).bottom,
      };
    }""")
    assert layout["overflow"] <= 0, f"the tuner is wider than the notebook at {width} px: {layout}"
    assert not layout["clipped"], f"labels cut off at {width} px: {layout['clipped']}"
    assert layout["image"]["right"] <= layout["rootRight"] + 1, f"the plot is cut off at {width} px: {layout}"
    # With the tuner scrolled to the top, the whole plot is on screen: move a control, see the plot.
    assert layout["image"]["bottom"] <= layout["visibleBottom"], \
        f"controls, verdict and plot do not fit a {width} x {height} screen: {layout}"
    # Four groups, two per row: the controls take two short rows, not four.
    tops = layout["groupTops"]
    assert len(tops) == 4 and tops[0] == tops[1] and tops[2] == tops[3] and tops[2] > tops[0], layout
    for unit_label in ("batch (seqs/GPU)", "prompt (tokens)", "new (tokens)", "sequence (tokens)"):
        assert unit_label in layout["labels"], f"{unit_label!r} missing: {layout['labels']}"
