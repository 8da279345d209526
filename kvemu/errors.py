"""Exceptions the library raises. The CLI turns every KvemuError into one line and exit code 2.

Each is also the built-in exception it is a kind of, so that a library caller can catch it as one:
bad values (options, traces, workloads, results files) are ``ValueError``; failures of files and
of the C backends, which carry an errno, are ``OSError``."""

import re
import resource


class KvemuError(Exception):
    """Base class: a problem the user can fix, reported as one line without a traceback."""

    exit_code = 2


class TraceError(KvemuError, ValueError):
    """A trace file is unreadable, not a kvemu trace, or inconsistent."""


class ResultsError(KvemuError, ValueError):
    """A results file is unreadable or not a kvemu results file."""


class WorkloadError(KvemuError, ValueError):
    """A workload source (Mooncake JSONL, Azure CSV, synthetic spec) is malformed."""


class ConfigError(KvemuError, ValueError):
    """An option, model preset, GPU preset or config file is invalid or contradictory."""


class OutputError(KvemuError, OSError):
    """An output cannot be written (exists without --force, folder not writable, disk full)."""


class OptionError(ConfigError):
    """A field of an options object of the Python API (kvemu.RecordOptions, kvemu.ReplayOptions) has
    a bad value. ``field`` is its dotted name (``"stores.timing"``), ``reason`` the rest of the
    sentence, in which ``{group.field}`` names another field. The message names the fields; the
    command line names its flags instead (:meth:`render` with cli's table of flags)."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(self.render(lambda name: name))

    def render(self, name_of) -> str:
        """The message with every field named by ``name_of(field)``."""
        reason = re.sub(r"\{([a-z_]+\.[a-z_]+)\}", lambda m: name_of(m.group(1)), self.reason)
        return f"{name_of(self.field)} {reason}"

    def __reduce__(self):
        return type(self), (self.field, self.reason)


class ResourceLimitError(KvemuError):
    """A run would need more memory or disk than allowed; refused before allocating."""


class BackendError(KvemuError, OSError):
    """A C backend call failed; carries the errno and the backend's own message."""

    def __init__(self, message: str, errno: int = 0):
        OSError.__init__(self, message)
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ComponentError(KvemuError):
    """A component kvemu relies on (a Dask scheduler) failed mid-run: one line naming it, what
    survived and what to rerun."""


class BackendUnavailable(BackendError):
    """The backend cannot run on this machine (missing hardware, kernel feature or permission)."""


def out_of_memory_message(command: str | None) -> str:
    """The line for a MemoryError (an allocation the process's limits refused): the limit, and
    the address space the process had reached, a lower bound on what the run needs."""
    def gib(n: float) -> str:
        return f"{n / 2**30:.2f} GiB"

    peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmPeak:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    limit = f"the address-space limit (ulimit -v) is {gib(soft)}" if soft != resource.RLIM_INFINITY \
        else "the machine's memory is exhausted"
    need = f"; the process had reached {gib(peak)} and needs more" if peak else ""
    hint = {"record": "record fewer requests (--max-requests, --window-ms)",
            "replay": "replay fewer requests or layers (--requests, --layers)",
            }.get(command or "", "give a smaller input")
    return f"out of memory: {limit}{need}; raise the limit or {hint}"
