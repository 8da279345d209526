"""Exceptions the library raises. The CLI turns every KvemuError into one line and exit code 2."""


class KvemuError(Exception):
    """Base class: a problem the user can fix, reported as one line without a traceback."""

    exit_code = 2


class TraceError(KvemuError):
    """A trace file is unreadable, not a kvemu trace, or inconsistent."""


class ResultsError(KvemuError):
    """A results file is unreadable or not a kvemu results file."""


class WorkloadError(KvemuError):
    """A workload source (Mooncake JSONL, Azure CSV, synthetic spec) is malformed."""


class ConfigError(KvemuError):
    """An option, model preset, GPU preset or config file is invalid or contradictory."""


class OutputError(KvemuError):
    """An output cannot be written (exists without --force, folder not writable, disk full)."""


class ResourceLimitError(KvemuError):
    """A run would need more memory or disk than allowed; refused before allocating."""


class BackendError(KvemuError):
    """A C backend call failed; carries the errno and the backend's own message."""

    def __init__(self, message: str, errno: int = 0):
        super().__init__(message)
        self.errno = errno


class BackendUnavailable(BackendError):
    """The backend cannot run on this machine (missing hardware, kernel feature or permission)."""
