"""Where things live in a checkout. One place, so the CLI, notebooks and tests agree."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PARAMS_DIR = REPO_ROOT / "params"
OUTPUTS_DIR = REPO_ROOT / "outputs"
REFERENCE_DIR = OUTPUTS_DIR / "reference"
MODELS_DIR = OUTPUTS_DIR / "models"  # built models (the tiny one); git-ignored
