"""The router of closed-loop replay with several instances: arriving requests go to instances in
arrival order and at the time they arrive, by a policy (ROUTING), while the instances' clocks are
kept in step so that every decision sees the state at its time."""

from __future__ import annotations

import bisect
import threading
from collections import deque

import numpy as np

from ...errors import ConfigError
from .inputs import EngineInputs

#: How closed-loop replay routes requests to instances (Router).
ROUTING = ("round-robin", "least-loaded", "prefix-aware")


class Router:
    """Routes arriving requests to N instances, each running its own engine, in arrival order and
    at the time they arrive; keeps the instances' clocks in step so that every decision sees the
    state at that time.

    An arrival at time T is routed once every instance's clock (the end of its last step, when it
    plans the next) is at least T, or the instance is idle. An instance plans a step at t once every
    arrival up to t is routed. With ``lockstep`` only the instance with the earliest clock plans
    (emulated and virtual tiers: the order of steps is then that of the timeline, and the shared
    tier's queue is served in time order); otherwise instances run concurrently, as real tiers are
    accessed, and wait only for the routing.

    Policies: ``round-robin`` (the k-th arrival to instance k mod N); ``least-loaded`` (the fewest
    requests routed and not finished at T; ties to the lowest index); ``prefix-aware`` (as
    Mooncake's conductor: the instance where the request's uncached blocks plus the work queued
    there are least, a block counting as cached on an instance that was routed a request holding
    it, whether or not that instance has evicted it since, and each queued request as an average
    request's blocks).
    """

    def __init__(self, n: int, inputs: EngineInputs, policy: str, selected: np.ndarray, lockstep: bool,
                 order=None, fixed=None):
        """``order``: the requests to route, in their arrival order (their ``inputs.arrival_ns``
        non-decreasing along it); None: every request, in id order (a trace's arrival order).
        ``fixed``: each request's instance, chosen beforehand (the policy named it: a disaggregated
        deployment's decode side, whose receiving NICs needed it before the hand-off)."""
        if policy not in ROUTING:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING)}, got {policy!r}")
        self.n, self.policy, self.lockstep = n, policy, lockstep
        self.order = None if order is None else np.asarray(order, np.int64).tolist()
        self.arrival = (inputs.arrival_ns.tolist() if order is None
                        else inputs.arrival_ns[np.asarray(order, np.int64)].tolist())
        self.tables = inputs.tables
        self.n_full = inputs.tables.n_full_input.tolist()
        self.cond = threading.Condition()
        self.clock = [0] * n
        self.parked = [False] * n
        self.sleeping = [False] * n   # idle until a deadline (an async load), or until a request comes
        self.gone = [False] * n
        self.wake: list = [None] * n
        self.inbox = [deque() for _ in range(n)]
        self.k = 0
        self.owner = np.full(len(inputs.arrival_ns), -1, np.int32)
        self.routed = [0] * n
        self.completed: list[list[int]] = [[] for _ in range(n)]   # completion times, sorted
        self.selected = selected.tolist()
        self.selected_left = int(np.count_nonzero(selected))
        self.home: dict = {}         # prefix-aware: block id -> bit mask of the instances routed it
        self.blocks_seen = self.requests_seen = 0
        self.failed = False
        self.fixed = None if fixed is None else np.asarray(fixed, np.int64).tolist()

    # -- called by the instances' threads
    def advance(self, i: int, t: int) -> bool:
        """Instance i plans its next step at t: wait until that is allowed. False: stop."""
        with self.cond:
            self.clock[i] = t
            self._route()
            self.cond.notify_all()
            while not self._done() and not self._may_plan(i, t):
                self.cond.wait(0.2)
            return not self._done()

    def park(self, i: int, deadline=None):
        """Instance i has nothing to do: wait for a request routed to it (wake at its arrival) or,
        given a deadline (an async load done then), until then at the latest. None: the end."""
        with self.cond:
            if deadline is None:
                self.parked[i] = True
            else:
                self.sleeping[i] = True
                self.clock[i] = self.wake[i] = int(deadline)
            self._route()
            self.cond.notify_all()
            while not self._done() and self.parked[i]:
                if self.k >= len(self.arrival) and all(self.parked[j] or self.gone[j] for j in range(self.n)):
                    self.cond.notify_all()
                    return None
                self.cond.wait(0.2)
            if self._done():
                return None
            while not self._done() and not self._may_plan(i, self.wake[i]):
                self.cond.wait(0.2)
            self.sleeping[i] = False
            return None if self._done() else self.wake[i]

    def complete(self, i: int, rids, t: int) -> None:
        with self.cond:
            for r in rids:
                bisect.insort(self.completed[i], t)
                if self.selected[r]:
                    self.selected_left -= 1
            if self.selected_left <= 0:
                self.cond.notify_all()

    def leave(self, i: int) -> None:
        with self.cond:
            self.gone[i] = True
            self.parked[i] = True
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    # -- inside the lock
    def _done(self) -> bool:
        return self.failed or self.selected_left <= 0

    def _horizon(self) -> float:
        live = [self.clock[j] for j in range(self.n) if not self.parked[j]]
        return min(live) if live else float("inf")

    def _may_plan(self, i: int, t: int) -> bool:
        if self.k < len(self.arrival) and self.arrival[self.k] <= t:
            return False  # an arrival up to t is not routed yet
        if not self.lockstep:
            return True
        return all(self.parked[j] or (self.clock[j], j) >= (t, i) for j in range(self.n))

    def _route(self) -> None:
        while self.k < len(self.arrival) and self.arrival[self.k] <= self._horizon():
            r, t = (self.k if self.order is None else self.order[self.k]), self.arrival[self.k]
            j = self._choose(r, t)
            self.owner[r] = j
            self.routed[j] += 1
            self.inbox[j].append(r)
            if (self.parked[j] or (self.sleeping[j] and t < self.clock[j])) and not self.gone[j]:
                self.parked[j] = False
                self.clock[j] = t
                self.wake[j] = t
            self.k += 1

    def _load(self, j: int, t: int) -> int:
        return self.routed[j] - bisect.bisect_right(self.completed[j], t)

    def _choose(self, r: int, t: int) -> int:
        if self.fixed is not None:
            return self.fixed[r]
        live = [j for j in range(self.n) if not self.gone[j]] or list(range(self.n))
        if self.policy == "round-robin":
            return live[self.k % len(live)]  # the k-th arrival
        if self.policy == "least-loaded":
            return min(live, key=lambda j: (self._load(j, t), j))
        t_ids = self.tables.ids[self.tables.offsets[r]:self.tables.offsets[r] + self.n_full[r]].tolist()
        hit = {}
        home = self.home
        for j in live:
            bit, n_hit = 1 << j, 0
            for b in t_ids:
                if not home.get(b, 0) & bit:
                    break
                n_hit += 1
            hit[j] = n_hit
        # Mooncake's conductor weighs the prefix an instance holds against the work queued there: the
        # blocks this request must compute on j, plus the requests j already has, each an average
        # request's blocks of work
        self.blocks_seen += len(t_ids)
        self.requests_seen += 1
        avg = self.blocks_seen / self.requests_seen
        j = min(live, key=lambda j: (len(t_ids) - hit[j] + self._load(j, t) * avg, j))
        bit = 1 << j
        for b in t_ids:
            home[b] = home.get(b, 0) | bit
        return j
