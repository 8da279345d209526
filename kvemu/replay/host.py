"""The host a replay ran on, as the results record it (also calibrate's profiles), what
/proc/meminfo says of its memory, and how loaded it was while a run measured it (``host_load``)."""

from __future__ import annotations

import os
import platform
import socket
import time

#: Other processes' share of this host's CPU time over a measurement from which they moved its
#: figures (docs/replay.md, "Host load"): on a 2-CPU host, half a CPU. A judgement, not a fit: the
#: data path's transfer workers run one per CPU, so any CPU time another process takes is time a
#: worker waits, and from about half a CPU of two the waits are no longer rare.
OTHERS_SHARE_LIMIT = 0.25
#: A measurement shorter than this is not judged (clock ticks of 10 ms make its shares noise).
LOAD_MIN_WALL_S = 0.5


def host_facts() -> dict:
    facts = {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "page_size": os.sysconf("SC_PAGE_SIZE"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    facts["memory_bytes"] = meminfo("MemTotal")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            facts["thp"] = f.read().strip()
    except OSError:
        pass
    return facts


def meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_sample(children: bool = False) -> dict:
    """This host's load at one moment: the 1-minute load average, this process's CPU seconds (all
    its threads; with ``children``, also those of its children that have ended and been waited for: a
    measurement run in a child of its own, kvemu.isolation), and from /proc/stat the host's busy and
    total CPU seconds over all its CPUs (None where /proc/stat cannot be read)."""
    t = os.times()
    own = t.user + t.system + ((t.children_user + t.children_system) if children else 0.0)
    sample = {"t": time.monotonic(), "loadavg_1m": _loadavg(), "process_cpu_s": own,
              "host_busy_s": None, "host_total_s": None, "cpus": os.cpu_count()}
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        tick = os.sysconf("SC_CLK_TCK")
        total = sum(fields)
        sample["host_total_s"] = total / tick
        sample["host_busy_s"] = (total - fields[3] - fields[4]) / tick  # steal counts as taken by others
        sample["cpus"] = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit()) or sample["cpus"]
    except (OSError, ValueError, IndexError):
        pass
    return sample


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def host_load(before: dict, after: dict) -> dict:
    """The host's load over a measurement, from :func:`load_sample` before and after it (results
    ``host_load``, calibrate's ``host_load``): the load averages, this process's CPU share (in CPUs:
    2.0 is two CPUs busy for the whole time), the share of the host's CPU time other processes took,
    and ``moved`` (that share reached OTHERS_SHARE_LIMIT; None when it could not be judged)."""
    wall = max(after["t"] - before["t"], 0.0)
    mine = max(after["process_cpu_s"] - before["process_cpu_s"], 0.0)
    d = {"loadavg_1m_before": before["loadavg_1m"], "loadavg_1m_after": after["loadavg_1m"],
         "wall_s": round(wall, 3), "cpus": after["cpus"],
         "process_cpus": round(mine / wall, 3) if wall > 0 else None,
         "others_share": None, "limit": OTHERS_SHARE_LIMIT, "moved": None}
    if before["host_total_s"] is not None and after["host_total_s"] is not None and wall >= LOAD_MIN_WALL_S:
        span = after["host_total_s"] - before["host_total_s"]
        busy = after["host_busy_s"] - before["host_busy_s"]
        if span > 0:
            others = min(max(busy - mine, 0.0) / span, 1.0)
            d["others_share"] = round(others, 3)
            d["moved"] = others >= OTHERS_SHARE_LIMIT
    return d


def load_warning(load: dict | None, what: str) -> str | None:
    """One line when other processes took a share of this host that moves ``what``'s figures."""
    if not load or not load.get("moved"):
        return None
    cpus = load.get("cpus") or 1
    return (f"other processes took {load['others_share']:.0%} of this host's {cpus} CPUs while {what} ran "
            f"(load average {load['loadavg_1m_before']} before, {load['loadavg_1m_after']} after; this process "
            f"{load['process_cpus']:.2f} CPUs): its measured figures are this host's contention as much as the "
            f"tier's; rerun on a quiet host (results host_load)")
