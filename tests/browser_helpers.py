"""Start JupyterLab and headless Chromium for the browser tests, and drive JupyterLab like a person.

Kept apart from the test so the test reads as the story a user would tell: open the notebook, run
it, move the batch slider, pick another model, look at the verdict and the figure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Debian's chromium package; Playwright's own browser download cannot work on a closed network.
CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps trying Google's hosts, and on a closed
# network every attempt fails (noisy, and slow to start). --disable-dev-shm-usage: a container's
# small /dev/shm crashes the renderer; /tmp is used instead.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic",
                  "--disable-dev-shm-usage")
# What `make test` does when chromium is missing; said in the skip/failure message.
INSTALL_HINT = "install it with `sudo apt-get install chromium` (Debian) or run `make test` as root"

# JupyterLab's own notifications would cover the tuner in screenshots and ask questions nobody
# answers in a test: no news feed, no update check, no "do you want news?" prompt.
LAB_SETTING_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"checkForUpdates": False, "fetchNews": "false"},
}
LAB_START_SECONDS = 60


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class JupyterLab:
    """A JupyterLab server this test started: its base URL, token, process and log file."""
    url: str
    token: str
    process: subprocess.Popen
    log_path: Path

    def lab_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"

    def log_tail(self, characters: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-characters:] if self.log_path.exists() else ""


def start_jupyterlab(root_dir: Path, state_dir: Path) -> JupyterLab:
    """Start JupyterLab on 127.0.0.1 with a random token, serving `root_dir`; wait until it answers.

    It runs with this interpreter (the venv), so its `python3` kernel is the venv's and imports
    `workbook`. Jupyter's config, data, runtime and settings folders point into `state_dir`, so
    nothing in the user's home (a stale kernelspec, lab settings, open workspaces) changes the test.
    """
    token = secrets.token_hex(24)
    port = free_port()
    for name in ("config", "data", "runtime", "settings", "workspaces"):
        (state_dir / name).mkdir(parents=True, exist_ok=True)
    # User settings, one file per plugin (overrides.json would belong in the venv's app dir).
    for plugin, values in LAB_SETTING_OVERRIDES.items():
        package, name = plugin.split(":")
        target = state_dir / "settings" / package / f"{name}.jupyterlab-settings"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values))
    env = {**os.environ,
           "JUPYTER_CONFIG_DIR": str(state_dir / "config"), "JUPYTER_DATA_DIR": str(state_dir / "data"),
           "JUPYTER_RUNTIME_DIR": str(state_dir / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(state_dir / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(state_dir / "workspaces"),
           # The tuner shows its figure with display(); under a non-inline MPLBACKEND (Agg, set by
           # some CI setups) that prints "Figure(1000x320)" instead of the image.
           "MPLBACKEND": "module://matplotlib_inline.backend_inline", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
               # CI runs as root; nothing here should reach the network on its own.
               "--ServerApp.allow_root=True", "--ServerApp.terminals_enabled=False",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly"]
    log_path = state_dir / "jupyterlab.log"
    with open(log_path, "wb") as log:
        # Its own session: a Ctrl+C meant for pytest does not reach it half-way through a test.
        process = subprocess.Popen(command, cwd=root_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    lab = JupyterLab(f"http://127.0.0.1:{port}", token, process, log_path)
    deadline = time.monotonic() + LAB_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {process.returncode} before answering; its log:\n"
                               + lab.log_tail())
        try:
            with urllib.request.urlopen(f"{lab.url}/api/status?token={token}", timeout=2) as answer:
                if answer.status == 200:
                    return lab
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    stop_jupyterlab(lab)
    raise RuntimeError(f"JupyterLab did not answer on {lab.url} within {LAB_START_SECONDS} s; its log:\n"
                       + lab.log_tail())


def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (the kernels a server started), read from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (command) state ppid ...": the command may hold spaces, so split after ')'.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def stop_jupyterlab(lab: JupyterLab, grace_seconds: float = 15) -> None:
    """Stop the server with SIGTERM (it shuts its kernels down first); kill what is left after that."""
    kernels = _child_pids(lab.process.pid)
    if lab.process.poll() is None:
        lab.process.terminate()
        try:
            lab.process.wait(timeout=grace_seconds)
            return
        except subprocess.TimeoutExpired:
            lab.process.kill()
            lab.process.wait(timeout=grace_seconds)
    for pid in kernels:  # the server did not stop by itself, so its kernels are still ours to stop
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def chromium_missing_reason() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
        return f"{CHROMIUM} is not installed: {INSTALL_HINT}"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is missing: `pip install -r requirements.txt`"
    return None


def parameterized_notebook(source: Path, folder: Path, profile: str, run_dir: Path, **overrides) -> Path:
    """A copy of `source` in `folder` with papermill's injected parameters cell, not executed.

    The values are the profile's file plus `overrides`, filtered to what the notebook declares by
    `runner.notebook_parameters`, exactly as `workbook run` injects them.
    """
    import papermill

    from workbook import params, runner

    values = {**params.load(params.profile_path(profile)), **overrides}
    parameters = runner.notebook_parameters(source, values, run_dir)
    target = folder / source.name
    papermill.execute_notebook(str(source), str(target), parameters=parameters, prepare_only=True,
                               progress_bar=False, kernel_name="python3")
    return target


# Records, once per painted frame, whether the figure's image was shown and how tall the figure
# was: a frame without a decoded image is a flicker, a smaller height makes the page jump.
WATCH_FIGURE_JS = """(output) => {
  const probe = {frames: 0, framesWithoutImage: 0, minHeight: Infinity, running: true};
  const tick = () => {
    if (!probe.running) return;
    const images = output.querySelectorAll('img');
    const shown = images.length === 1 && images[0].complete && images[0].naturalHeight > 0;
    probe.frames += 1;
    probe.framesWithoutImage += shown ? 0 : 1;
    probe.minHeight = Math.min(probe.minHeight, output.getBoundingClientRect().height);
    requestAnimationFrame(tick);
  };
  output.__figureProbe = probe;
  requestAnimationFrame(tick);
}"""
STOP_WATCHING_JS = """(output) => {
  const probe = output.__figureProbe;
  probe.running = false;
  return {frames: probe.frames, framesWithoutImage: probe.framesWithoutImage, minHeight: probe.minHeight};
}"""
