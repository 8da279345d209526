"""The host a replay ran on, as the results record it (also calibrate's profiles), and what
/proc/meminfo says of its memory."""

from __future__ import annotations

import os
import platform
import socket


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
