"""The user-facing exceptions: the CLI reports them as one line (no traceback). Nothing from del_bench is
imported here, so any module can raise them without pulling in another."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run; raised before any model is loaded."""


class RunConflict(RuntimeError):
    pass


class TaskError(ValueError):
    """A task's data cannot be read; the message names the task, the source and the way out."""


class CalibrationError(RuntimeError):
    pass


class Busy(RuntimeError):
    """Another process is writing this out_dir."""
