"""Building the arrays kv_replay takes, for the backend tests."""

import numpy as np

from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE


def csr(tables):
    """Block tables (lists of slots) as the (table_off, table_slots) pair replay takes."""
    off = np.zeros(len(tables) + 1, np.uint64)
    off[1:] = np.cumsum([len(t) for t in tables])
    slots = np.array([s for t in tables for s in t], np.uint32)
    return off, slots


def make_entries(rows):
    """rows: (req, (load_first, load_count), (store_first, store_count), (read_first, read_count))."""
    e = np.zeros(len(rows), ENTRY_DTYPE)
    for i, (req, ld, st, rd) in enumerate(rows):
        e[i] = (req, *ld, *st, *rd)
    return e


def make_steps(bounds, compute_ns=0):
    s = np.zeros(len(bounds), STEP_DTYPE)
    for i, (b, e) in enumerate(bounds):
        s[i] = (b, e, compute_ns, 0)
    return s


def span(*values):
    return np.array(values, np.uint32)


def replay_one(b, slot: int, op: str, n_layers: int = 2) -> None:
    """One step of one request whose block table is [slot]: one `op` of it on every replayed layer."""
    entries = np.zeros(1, ENTRY_DTYPE)
    entries[0][f"{op}_count"] = 1
    steps = np.array([(0, 1, 0, 0)], STEP_DTYPE)
    b.replay(np.array([0, 1], np.uint64), np.array([slot], np.uint32), steps, entries,
             np.ones(n_layers, np.uint32))


def load_steps(n_steps: int, per_step: int) -> tuple:
    """kv_replay's arguments for n_steps steps of one request, each loading its per_step blocks
    (slots 0 .. per_step-1) on one replayed layer."""
    entries = np.zeros(n_steps, ENTRY_DTYPE)
    entries["load_count"] = per_step
    steps = np.zeros(n_steps, STEP_DTYPE)
    steps["entry_begin"] = np.arange(n_steps)
    steps["entry_end"] = np.arange(1, n_steps + 1)
    return (np.array([0, per_step], np.uint64), np.arange(per_step, dtype=np.uint32), steps, entries,
            np.ones(1, np.uint32))
