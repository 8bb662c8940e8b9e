"""The newcomer's path: `make lab` starts where a rented GPU container runs it (as root), and the
parameters file each notebook of a run gets reruns it alone with papermill, without a warning."""

import os
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import papermill
import pytest
import yaml

from browser_helpers import free_port
from workbook import params, runner
from workbook.paths import NOTEBOOKS_DIR, PARAMS_DIR, REPO_ROOT


def make_lab_command() -> list[str]:
    """The command `make lab` runs with this venv, read with `make -n` (the set-up step left out)."""
    venv = Path(sys.executable).parent.parent
    # --no-print-directory: under `make test` (CI) this make is nested and would print "Leaving directory".
    printed = subprocess.run(["make", "--no-print-directory", "-n", "-o", f"{venv}/.installed", "lab", f"VENV={venv}"],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return shlex.split(printed.strip().splitlines()[-1])


@pytest.mark.slow
def test_make_lab_starts_as_root_too(tmp_path):
    # JupyterLab exits at once as root unless told --allow-root; root is the usual user on a rented GPU.
    command = make_lab_command()
    assert ("--allow-root" in command) == (os.geteuid() == 0)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, **{f"JUPYTER_{name.upper()}_DIR": str(tmp_path / name) for name in ("config", "data", "runtime")}}
    lab = subprocess.Popen(command + ["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                                      "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}"],
                           cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / "lab.log", "wb"), start_new_session=True)
    try:
        deadline, answered = time.monotonic() + 120, False
        while time.monotonic() < deadline and lab.poll() is None and not answered:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as answer:
                    answered = answer.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        assert answered, (tmp_path / "lab.log").read_text()[-3000:]
    finally:
        lab.terminate()
        try:
            lab.wait(timeout=30)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait()


def test_each_notebooks_parameters_file_holds_only_what_it_declares_with_the_command_to_rerun_it(tmp_path):
    # papermill warns once per parameter a notebook does not declare; these files give it nothing to warn about.
    cpu = params.load(PARAMS_DIR / "cpu.yaml")
    for path in runner.list_notebooks(NOTEBOOKS_DIR):
        values = runner.notebook_parameters(path, cpu, tmp_path)
        written = runner.write_parameters_file(path, values, tmp_path)
        assert yaml.safe_load(written.read_text()) == values  # the same values and types papermill will inject
        assert set(values) <= set(papermill.inspect_notebook(str(path))), path.name
        assert f"papermill notebooks/{path.name} " in written.read_text() and f"-f {written}" in written.read_text()
