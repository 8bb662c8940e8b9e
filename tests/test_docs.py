"""What a user reads stays short and about the workbook, not about its history: the README fits in a
five-minute read, and nothing a user reads (README, params, notebooks, --help, plot titles) points to an
issue tracker they cannot open, a dated run, or a folder on the machine that made it. Measurement
narratives, dated, live beside their data in outputs/reference/; their paths are the checkout's."""

import contextlib
import io
import json
import re

import pytest

from workbook import cli, plots
from workbook.paths import NOTEBOOKS_DIR, PARAMS_DIR, REFERENCE_DIR, REPO_ROOT

README = REPO_ROOT / "README.md"
README_MAX_LINES = 230

# "issue 20", "issues 10, 18", "issue #7", and a bare "#20" (not a colour such as "#937860": six hex digits).
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w&#])#\d{1,5}\b(?![0-9a-fA-F])", re.IGNORECASE)
# A dated run: an ISO date (2026-11-25) or a clock time in UTC (01:38 UTC).
DATED_RUN = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b\d{1,2}:\d\d\s*UTC\b")
# A folder of the machine that made a file: a reader elsewhere has none of them.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home)/")


def offences(text: str, *patterns: re.Pattern) -> list[str]:
    """Each match of `patterns` in `text`, with its line number and the line, for the failure message."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in patterns:
            found += [f"line {number}: {match.group(0)!r} in {line.strip()[:160]!r}" for match in pattern.finditer(line)]
    return found


def test_the_readme_is_a_five_minute_read():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move measurement narratives beside "
        f"their data in outputs/reference/*.md and link them")


def test_the_readme_says_early_how_to_use_your_own_model():
    """The first thing a renter asks: the instruction, not a caveat, in the first quarter of the file."""
    text = README.read_text(encoding="utf-8")
    first_quarter = "\n".join(text.splitlines()[:README_MAX_LINES // 4])
    assert "--set model=" in first_quarter and "prompts_path=" in first_quarter


def test_every_reference_file_the_readme_links_exists():
    text = README.read_text(encoding="utf-8")
    linked = set(re.findall(r"outputs/reference/[\w./-]+\.md", text))
    assert linked, "the README links the measurement narratives in outputs/reference/"
    assert [path for path in sorted(linked) if not (REPO_ROOT / path).is_file()] == []


def test_the_readme_has_no_issue_numbers_dates_or_machine_paths():
    assert offences(README.read_text(encoding="utf-8"), ISSUE_NUMBER, DATED_RUN, MACHINE_PATH) == []


@pytest.mark.parametrize("path", sorted(PARAMS_DIR.glob("*.yaml")), ids=lambda path: path.name)
def test_params_files_have_no_issue_numbers_or_dates(path):
    assert offences(path.read_text(encoding="utf-8"), ISSUE_NUMBER, DATED_RUN, MACHINE_PATH) == []


@pytest.mark.parametrize("path", sorted(NOTEBOOKS_DIR.glob("*.ipynb")), ids=lambda path: path.name)
def test_notebooks_have_no_issue_numbers_or_dates(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = [f"cell {index} ({cell['cell_type']}) {offence}" for index, cell in enumerate(cells)
             for offence in offences("".join(cell["source"]), ISSUE_NUMBER, DATED_RUN, MACHINE_PATH)]
    assert found == []


def subcommands() -> list[str]:
    """Every `workbook <name>`, read from the parser itself, so a subcommand added later is checked too."""
    [action] = [action for action in cli.build_parser()._actions if action.dest == "command"]
    return sorted(action.choices)


def help_text(argv: list[str]) -> str:
    """What `workbook <argv> --help` prints (argparse exits 0 after printing it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*argv, "--help"])
    assert exit_info.value.code in (0, None), f"workbook {' '.join(argv)} --help exited {exit_info.value.code}"
    return out.getvalue()


def test_help_of_workbook_and_every_subcommand_has_no_issue_numbers_or_dates():
    names = subcommands()
    assert {"run", "plan", "generate", "train", "bench", "forecast"} <= set(names)
    found = {" ".join(["workbook", *argv]): offences(help_text(argv), ISSUE_NUMBER, DATED_RUN, MACHINE_PATH)
             for argv in ([], *([name] for name in names))}
    assert {command: lines for command, lines in found.items() if lines} == {}


def figure_titles(figure) -> list[str]:
    """Every title of the figure: its suptitle, each axis's (all three positions), each legend's."""
    texts = [figure._suptitle.get_text()] if figure._suptitle else []
    for axis in figure.axes:
        texts += [axis.get_title(loc) for loc in ("left", "center", "right")]
        legends = [axis.get_legend()] if axis.get_legend() else []
        texts += [legend.get_title().get_text() for legend in legends]
    texts += [legend.get_title().get_text() for legend in figure.legends]
    return [text for text in texts if text]


def test_plot_titles_show_a_model_or_data_path_without_the_machine_s_folders():
    """A notebook passes its model and data paths into titles; the PNG is shared, the folders are not."""
    outside = "/models/Llama-3.1-8B-Instruct"
    inside = REPO_ROOT / "outputs" / "models" / "tiny-32d8f802"
    lengths = plots.training_lengths([12, 30, 64], 64, {"median": 30, "p95": 62, "p99": 64, "max": 64}, 0,
                                     str(REPO_ROOT / "data" / "teacher.accepted.jsonl"))
    curves = plots.training_curves([{"step": 1, "loss": 2.0, "tokens_per_second": 10.0}], [],
                                   f"tiny: weights from {inside}, fp32 on cpu")
    timeline = plots.generation_timeline(
        [{"finished_at_seconds": 0.5, "seconds": 0.5, "output_tokens": 32, "examples": 4, "failed": 0,
          "longest_output_tokens": 8, "rank": 0}],
        f"{outside}, static, batch 4, bf16 on cuda")
    titles = [*figure_titles(lengths), *figure_titles(curves), *figure_titles(timeline)]
    assert [title for title in titles if re.search(r"(?:^|[\s(=\"'])/\w", title)] == []  # no absolute path at all
    joined = "\n".join(titles)
    # What the reader needs stays: the path inside the checkout, the model's own folder name outside it.
    assert "data/teacher.accepted.jsonl" in joined and "outputs/models/tiny-32d8f802" in joined
    assert "Llama-3.1-8B-Instruct" in joined


def test_committed_reference_results_have_no_machine_paths_or_issue_numbers():
    """Reference files are read on other machines: paths are the checkout's (outputs/models/...)."""
    files = sorted(path for path in REFERENCE_DIR.rglob("*") if path.suffix in (".md", ".json"))
    assert files
    found = {str(path.relative_to(REPO_ROOT)): offences(path.read_text(encoding="utf-8"), MACHINE_PATH)
             for path in files}
    found.update({f"{path.relative_to(REPO_ROOT)} (issue numbers)": offences(path.read_text(encoding="utf-8"),
                                                                             ISSUE_NUMBER)
                  for path in files if path.suffix == ".md"})
    assert {name: lines for name, lines in found.items() if lines} == {}
