"""Session graphs: which request continues which, and how long after its parent completes it is sent.

An agentic or chat session is a closed loop of its own: turn k+1 is sent when turn k's answer is
complete plus the tool or think time. A `SessionGraph` keeps, per request of a workload (in its
arrival order): ``parent`` (the index of the request it continues, always an earlier one, or -1 at a
session's root), ``gap_ms`` (the time from the parent's completion to this request: the trace's
tool or think time, or the recorded inter-arrival gap where that is all the trace has; 0 at a root),
``session`` (the index of the session's root request's session, numbered 0, 1, ... in order of
first arrival) and ``turn`` (0 at a root, the parent's turn + 1 otherwise: a sub-agent's turns
count on from the turn that spawned it). Traces keep it in their metadata (``sessions``,
docs/trace-format.md); closed-loop replay releases each non-root request at its parent's completion
plus ``gap_ms`` under ``--arrivals session`` (docs/replay.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SESSIONS_VERSION = 1
#: How each request's gap was obtained, the values of the trace's ``sessions.gap_from``.
GAP_SOURCES = ("trace", "inter-arrival", "mixed")


@dataclass(frozen=True, eq=False)
class SessionGraph:
    parent: np.ndarray   # int64, -1 at a root, else < own index
    gap_ms: np.ndarray   # float64, >= 0, finite
    session: np.ndarray  # int64
    turn: np.ndarray     # int64
    gap_from: str = "trace"

    @property
    def n_sessions(self) -> int:
        return int(self.session.max()) + 1 if len(self.session) else 0

    def to_meta(self) -> dict:
        return {"version": SESSIONS_VERSION, "gap_from": self.gap_from,
                "sessions": self.n_sessions, "max_turn": int(self.turn.max()) if len(self.turn) else 0,
                "parent": self.parent.tolist(), "gap_ms": self.gap_ms.tolist(),
                "session": self.session.tolist(), "turn": self.turn.tolist()}


def build_graph(parent: np.ndarray, gap_ms: np.ndarray, gap_from: str = "trace") -> SessionGraph:
    """Sessions and turns of a parent array (each parent earlier than its child)."""
    parent = np.asarray(parent, np.int64)
    n = len(parent)
    session = np.empty(n, np.int64)
    turn = np.empty(n, np.int64)
    sessions = 0
    for i, p in enumerate(parent.tolist()):
        if p < 0:
            session[i], turn[i] = sessions, 0
            sessions += 1
        else:
            session[i], turn[i] = session[p], turn[p] + 1
    return SessionGraph(parent, np.asarray(gap_ms, np.float64), session, turn, gap_from)


def graph_problem(parent, gap_ms, session, turn, n: int) -> str | None:
    """The first broken invariant of a session graph over ``n`` requests, or None."""
    arrays = {"parent": parent, "gap_ms": gap_ms, "session": session, "turn": turn}
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.ndim != 1 or len(a) != n:
            return f"sessions.{name} must list one value per request ({n})"
    idx = np.arange(n)
    if np.any((parent < -1) | (parent >= idx)):
        i = int(np.argmax((parent < -1) | (parent >= idx)))
        return f"sessions.parent[{i}] must be -1 or an earlier request, got {int(parent[i])}"
    if not np.all(np.isfinite(gap_ms)) or np.any(gap_ms < 0):
        return "sessions.gap_ms must be finite and >= 0"
    expect = build_graph(parent, gap_ms)
    if not np.array_equal(session, expect.session):
        return "sessions.session must number sessions by their roots in arrival order, a child in its parent's"
    if not np.array_equal(turn, expect.turn):
        return "sessions.turn must be 0 at a root and its parent's turn + 1 otherwise"
    return None


def graph_from_meta(meta: dict | None, n: int) -> SessionGraph | None:
    """The session graph a trace's metadata keeps (already validated), or None: no sessions."""
    if not meta:
        return None
    return SessionGraph(np.asarray(meta["parent"], np.int64), np.asarray(meta["gap_ms"], np.float64),
                        np.asarray(meta["session"], np.int64), np.asarray(meta["turn"], np.int64),
                        meta.get("gap_from", "trace"))


def children_of(parent: np.ndarray) -> list[list[int]]:
    """Each request's children, in index order."""
    kids: list[list[int]] = [[] for _ in range(len(parent))]
    for i, p in enumerate(np.asarray(parent).tolist()):
        if p >= 0:
            kids[p].append(i)
    return kids


class Release:
    """Session arrivals for the engine's scheduler (engine_steps ``release``): a root is released at
    its recorded arrival, any other request when its parent completes plus its gap. ``arrival_ns``
    holds, per request, when it was released (-1: never, its parent did not complete)."""

    def __init__(self, graph: SessionGraph, recorded_ns: np.ndarray, time_scale: float = 1.0):
        self.parent = graph.parent
        self.gap_ns = np.round(graph.gap_ms * time_scale * 1e6).astype(np.int64).tolist()
        self.children = children_of(graph.parent)
        self.arrival_ns = np.where(graph.parent < 0, np.asarray(recorded_ns, np.int64), -1)

    def roots(self) -> list[tuple[int, int]]:
        """(arrival, request) of every root, for the scheduler's heap."""
        r = np.flatnonzero(self.parent < 0)
        return list(zip(self.arrival_ns[r].tolist(), r.tolist()))

    def completed(self, rid: int, end_ns: int) -> list[tuple[int, int]]:
        """``rid`` completed at ``end_ns``: (arrival, request) of each child it releases."""
        out = []
        for c in self.children[rid]:
            t = end_ns + self.gap_ns[c]
            self.arrival_ns[c] = t
            out.append((t, c))
        return out
