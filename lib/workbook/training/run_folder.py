"""Which run folder ``workbook train`` trains into: a new one, or the one a kill interrupted.

A run folder made by the CLI records the command and the settings it resolved to (COMMAND_FILE).
Rerunning the same command resumes the newest run folder started by the same settings that holds a
complete checkpoint and no finished result, as ``workbook generate`` resumes its output file; a
finished run is never resumed (the rerun trains anew in a new folder). An explicit
train_output_dir skips the search: that folder resumes by itself (``loop.train``).

While a command trains, it holds an exclusive lock on the training folder (LOCK_FILE, ``flock``,
released by the kernel when the process ends, however it ends), so a second command started
meanwhile never trains into the same checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

from workbook import notebook, runner, runtime
from workbook.paths import OUTPUTS_DIR
from workbook.training import checkpoints
from workbook.training.config import PARAMS_USED, RESULT_FILE, TRAINING_DIR_NAME, TrainError

COMMAND_FILE = "train_command.json"  # in a run folder the CLI made: what started it, so a rerun finds it
LOCK_FILE = "training.lock"  # in the training folder; holds "pid on host" of the command training there


@dataclass
class RunFolder:
    """The folder a command trains in (``path``: metrics; its training folder: checkpoints, model)."""

    path: Path
    created: bool  # made by this command: removed again if its run never starts
    note: str  # what the console says about the choice
    lock: runtime.ExclusiveLock  # held on the training folder while this command trains there

    def release(self) -> None:
        self.lock.release()

    def discard(self) -> None:
        """Release the lock; remove a folder this command made for a run that never started (only if
        nothing but our own files is in it)."""
        self.release()
        if self.created:
            _remove_new(self.path)


@dataclass(frozen=True)
class FolderSettings:
    """What choosing the run folder reads, built once from the params at the CLI (``from_params``):
    before the folder is chosen no TrainConfig can be built, as its paths lie in the folder."""

    profile: str  # names a new run folder
    train_output_dir: str  # set: training goes there (resuming itself), metrics to a new run folder
    save_every_steps: int  # 0: no checkpoints, so an interrupted run cannot be resumed
    resumes: dict  # every key training reads, as JSON values: what a rerun must share with a run to resume it

    @classmethod
    def from_params(cls, params) -> "FolderSettings":
        return cls(profile=params["profile"], train_output_dir=params["train_output_dir"],
                   save_every_steps=params["save_every_steps"], resumes=training_settings(params))


def training_settings(params) -> dict:
    """What a rerun must share with a run to resume it: every key training reads, as JSON values."""
    return json.loads(json.dumps({key: params[key] for key in PARAMS_USED}, default=str))


def choose(wanted: FolderSettings, command: str) -> RunFolder:
    """The run folder for the settings ``wanted`` (of validated params, overrides applied), locked;
    ``command`` as typed.

    The runs looked at are in OUTPUTS_DIR (read when called, so tests can point it elsewhere).
    """
    settings = wanted.resumes
    if wanted.train_output_dir:
        folder = _new_folder(wanted, command)
        training_dir = Path(wanted.train_output_dir)
        try:
            lock = _lock(training_dir)
        except runtime.LockHeldError as held:
            _remove_new(folder)
            raise TrainError(f"train_output_dir {training_dir} is in use by {held.holder} (it holds "
                             f"{held.path}): wait for that run to end or stop it, or set another "
                             "train_output_dir") from None
        note = (f"train_output_dir is set: training in {training_dir} (its last checkpoint is resumed if it holds "
                f"one); metrics go to {folder}")
        return RunFolder(folder, True, note, lock)
    notes = []
    for folder in _runs_started_with(settings):
        training_dir = folder / TRAINING_DIR_NAME
        if not _resumable(training_dir):
            continue
        try:
            lock = _lock(training_dir)
        except runtime.LockHeldError as held:
            notes.append(f"{folder} was started by the same settings but is still training ({held.holder}): "
                         "not resumed")
            continue
        if not _resumable(training_dir):  # it finished while we looked
            lock.release()
            continue
        step = checkpoints.saved_state(checkpoints.latest_checkpoint(training_dir))["step"]
        notes.append(f"resuming {folder}: started by the same settings and interrupted before it finished; "
                     f"continuing from its checkpoint at step {step}, metrics go there")
        return RunFolder(folder, False, "\n".join(notes), lock)
    folder = _new_folder(wanted, command)
    lock = _lock(folder / TRAINING_DIR_NAME)  # nobody else knows this folder yet
    every = wanted.save_every_steps
    notes.append(f"new run folder {folder}" + (
        f" (a checkpoint every {every} step(s): if this run is interrupted, the same command resumes it)" if every else
        " (save_every_steps is 0, no checkpoints: an interrupted run starts over; set it to make a rerun resume)"))
    return RunFolder(folder, True, "\n".join(notes), lock)


def _runs_started_with(settings: dict) -> list[Path]:
    """Run folders whose command resolved to ``settings``, newest first."""
    runs = []
    root = OUTPUTS_DIR
    for record_path in root.glob(f"*/{COMMAND_FILE}") if root.is_dir() else []:
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue  # unreadable or half written: not a run to resume
        if isinstance(record, dict) and record.get("settings") == settings:
            runs.append((str(record.get("started", "")), record_path.parent.name, record_path.parent))
    return [folder for _, _, folder in sorted(runs, reverse=True)]


def _resumable(training_dir: Path) -> bool:
    """A complete checkpoint and no finished result (a killed run wrote no result, a stopped one another status)."""
    if checkpoints.latest_checkpoint(training_dir) is None:
        return False
    try:
        return json.loads((training_dir / RESULT_FILE).read_text()).get("status") != "finished"
    except (OSError, ValueError):
        return True


def _new_folder(wanted: FolderSettings, command: str) -> Path:
    # The place a CLI run folder is made (and where its manifest belongs).
    folder = notebook.new_run_dir(wanted.profile, OUTPUTS_DIR)
    record = {"command": command, "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "settings": wanted.resumes}
    (folder / COMMAND_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return folder


def _remove_new(folder: Path) -> None:
    """Remove a run folder this command made, if only our own files are in it. (A lock file elsewhere,
    in an explicit train_output_dir, stays: unlinking a lock file others may open is a race.)"""
    training_dir = folder / TRAINING_DIR_NAME
    ours = {training_dir, training_dir / LOCK_FILE, folder / COMMAND_FILE, folder / runner.MANIFEST_FILE}
    if any(path not in ours for path in folder.rglob("*")):
        return  # the run got further: keep what it wrote
    for leftover in (training_dir / LOCK_FILE, folder / COMMAND_FILE, folder / runner.MANIFEST_FILE):
        leftover.unlink(missing_ok=True)
    for empty in (training_dir, folder):
        with contextlib.suppress(OSError):
            empty.rmdir()


def _lock(training_dir: Path) -> runtime.ExclusiveLock:
    """The training folder's lock (the folder made if need be); LockHeldError names who holds it."""
    training_dir.mkdir(parents=True, exist_ok=True)
    return runtime.ExclusiveLock(training_dir / LOCK_FILE).acquire()
