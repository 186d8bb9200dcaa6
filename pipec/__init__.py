"""pipec: a pipeline-parallel schedule compiler (the CLI, the frontend and the IR here;
pipec.passes, pipec.codegen and pipec.runtime beside them)."""

import warnings

__version__ = "0.1.0"
"""The one place the version is written: pyproject.toml reads it from here."""

# torch warns at import when numpy is missing; pipec does not use numpy, and torch needs it only
# for conversions pipec never makes, so the warning would only alarm.
NO_NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"  # as in PYTHONWARNINGS
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
