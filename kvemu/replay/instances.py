"""Serving instances: the arena each one replays on, their backends opened, prepared, timed (or
substituted by an emulated counterpart), attached to a shared arena, run one thread each, and
what their backends' statistics say in the results."""

from __future__ import annotations

import resource
import threading
import time
from typing import NamedTuple

import numpy as np

from ..backend_spec import BackendSpec, counterpart_spec
from ..backends import Backend, cancel_all
from ..errors import BackendUnavailable, ConfigError, KvemuError
from ..links import effective_link, is_staged
from ..schema import OPS
from .arena import entries_in_span
from .describe import backend_outcome

# Pointer-chase hops that measure a memory tier's idle latency for the in-place read bound (~30-60 ms).
LATENCY_HOPS = 100_000


def raise_fd_limit(instances: int) -> None:
    """Raise the soft open-file limit towards the hard one when several instances run: each keeps
    a spill file and its backend's files (a tier file, io_uring rings) open. Where the hard limit
    is lower still, running out is reported by spill_error or the backend, in one line."""
    want = 64 + 8 * instances
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def instance_views(touched: np.ndarray, instances: int, sharing: str, virtual: bool, key_of=None, off_of=None,
                    chunk_blocks: int = 1) -> list[dict]:
    """What each instance replays on: its arena's size in blocks, whether it owns that arena (the
    first instance of a shared tier; every replicated one), and the map from block id to arena
    slot (None in virtual time, where slots are never used). With chunks of several blocks, each
    touched chunk gets chunk_blocks consecutive slots, its blocks at their offsets, so that the C
    replay moves a chunk's blocks as one transfer."""
    if instances == 1 or sharing == "shared":
        rows, owns = [np.logical_or.reduce(touched, axis=0)] * instances, [i == 0 for i in range(instances)]
    else:
        rows, owns = list(touched), [True] * instances
    views = []
    for row, own in zip(rows, owns):
        if key_of is None:
            n_slots = max(int(np.count_nonzero(row)), 1)
        else:
            chunks = np.zeros(len(row), bool)
            chunks[key_of[row]] = True
            n_slots = max(int(np.count_nonzero(chunks)), 1) * chunk_blocks
        slot_of = None
        # virtual time moves no byte, but its transfers are cut where a real arena's would be
        if not virtual or key_of is not None:
            if key_of is None:
                # dense slots in id order; an id no entry touches shares a slot and is never accessed
                slot_of = np.maximum(np.cumsum(row, dtype=np.int64) - 1, 0).astype(np.uint32)
            else:
                # in place in uint32 (slots are uint32): 8 bytes per block id at most, not 36 (the
                # closed loop's peak on a long trace)
                chunk_index = np.cumsum(chunks, dtype=np.uint32)
                del chunks
                np.maximum(chunk_index, 1, out=chunk_index)
                chunk_index -= 1
                slot_of = chunk_index[key_of]
                del chunk_index
                slot_of *= np.uint32(chunk_blocks)
                slot_of += off_of
                slot_of[~row] = 0
        views.append({"n_slots": n_slots, "owns_arena": own, "slot_of": slot_of})
    return views


def instance_spec(spec, i: int, sharing: str, attached: bool) -> str:
    """The backend spec instance i opens (BackendSpec.instance): its own file for replicated
    file-backed tiers; an attached instance maps the owner's existing file."""
    return BackendSpec.parse(spec).instance(i, sharing == "replicated", attached).text()


def _tier_latency(backend) -> tuple[float, str]:
    """The tier medium's idle latency for the in-place read bound: an emulated tier's profile, a
    pointer chase over a memory tier's arena (measured now), none for storage reached by I/O."""
    if backend.profile is not None:
        return float(backend.profile.issue_ns + backend.profile.latency_ns), "profile"
    if backend.kind.medium == "memory":
        try:
            return float(backend.chase(LATENCY_HOPS)), f"pointer chase over the arena ({LATENCY_HOPS} hops)"
        except KvemuError:
            return 0.0, "unavailable (the arena is too small to chase)"
    return 0.0, "none: storage is not reached with in-place loads"


def run_instances(views, accs, trace, s0, s1, spec, geometry, block_bytes, emulate_missing, warn, progress,
                   n_steps, timing, body=None, on_error=None, raw=None) -> dict:
    """Replays every instance (one thread each when there are several; cffi releases the GIL in C).
    ``body(i, backend, acc, stop, progress)``: what an instance runs once its backend is ready
    (closed loop; it returns the end of its timeline), instead of the recorded steps;
    ``on_error()``: called when an instance fails, so that the others stop waiting for it.
    ``raw`` (a list): gets (state, the backends' statistics, prepare seconds, the timelines' ends),
    for a caller that merges several runs into one outcome (replay.closed.disagg)."""
    n = len(views)
    shared = n > 1 and not views[1]["owns_arena"]
    owner_ready = threading.Event()
    released = threading.Barrier(n)
    state: dict = {"owner": None, "spec": spec, "requested": spec, "because": None}
    stats: list = [None] * n
    errors: list[BaseException] = []
    done = [0] * n
    stop = threading.Event()  # set on Ctrl-C / SIGTERM in the main thread: workers end at a batch boundary
    prepare_s = [0.0] * n     # opening, mapping and pre-faulting each instance's arena
    ends: list = [None] * n   # closed loop: the end of each instance's timeline
    backends: list = [None] * n
    backends_lock = threading.Lock()
    # One per attached instance, set once it closed its backend or will never open one: the owner
    # unmaps the shared arena only after all are set, whatever failed (the barrier alone would
    # let it go on once aborted).
    detached = [threading.Event() for _ in range(n)]

    def fail_others(i: int) -> None:
        """Stop every other instance at its next batch and end the C call it is in."""
        stop.set()
        with backends_lock:
            others = [b for j, b in enumerate(backends) if j != i and b is not None]
        for b in others:
            b.cancel()

    totals = [n_steps] * n  # each instance's own count of work (steps; in closed loop, requests)

    def report_progress(i, d, total):
        done[i] = d
        totals[i] = total
        if progress is not None:
            progress(sum(done), sum(totals))

    def work(i: int) -> None:
        v, acc, backend = views[i], accs[i], None
        attached = shared and i > 0
        try:
            if attached:
                owner_ready.wait()
                if state["owner"] is None:
                    return  # the owner failed; its error is reported
                backend = Backend(instance_spec(state["spec"], i, "shared", True))
                with backends_lock:
                    backends[i] = backend
                if stop.is_set():
                    return  # another instance failed before this one attached
                backend.attach(state["owner"])
                backend.set_timing(**state["timing"])
            else:
                t_prep = time.perf_counter()
                backend, opened = open_configured(instance_spec(spec, i, "replicated" if n > 1 else "shared", False),
                                                   (block_bytes, v["n_slots"], *geometry), emulate_missing, warn,
                                                   timing)
                prepare_s[i] = time.perf_counter() - t_prep
                with backends_lock:
                    backends[i] = backend
                if i == 0:
                    state.update(opened)
                    if shared:
                        state["owner"] = backend
            if i == 0:
                owner_ready.set()
            if body is not None:
                ends[i], extra = body(i, backend, acc, stop,
                                      None if progress is None else (lambda d, t, i=i: report_progress(i, d, t)))
                stats[i] = _merge_stats(backend_stats(backend), extra)
                return
            pending = None
            for e in entries_in_span(trace, s0, s1):
                if stop.is_set():
                    return
                if n > 1:
                    keep = e["request_id"] % n == i
                    if not keep.any():
                        continue
                    e = {k: x[keep] for k, x in e.items()}
                if pending is not None:
                    e = {k: np.concatenate([pending[k], e[k]]) for k in e}
                # hold back the batch's last step: its entries may continue in the next batch
                cut = int(np.searchsorted(e["step"], e["step"][-1], side="left"))
                pending = {k: x[cut:] for k, x in e.items()}
                if cut:
                    acc.replay_steps(backend, {k: x[:cut] for k, x in e.items()},
                                     lambda d, t, i=i: report_progress(i, d, t))
            if pending is not None and len(pending["step"]):
                acc.replay_steps(backend, pending, lambda d, t, i=i: report_progress(i, d, t))
            # after the replay: emulated tiers count their floor hits
            stats[i] = backend_stats(backend)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises the first
            errors.append(e)
            if n > 1:
                fail_others(i)
            if on_error is not None:
                on_error()
            owner_ready.set()
            released.abort()
        finally:
            if backend is not None and attached:
                backend.close()  # before the owner unmaps the arena
            detached[i].set()
            if n > 1:
                try:
                    released.wait()
                except threading.BrokenBarrierError:
                    pass
            if backend is not None and not attached:
                if shared:
                    for d in detached[1:]:
                        d.wait()
                backend.close()

    if n == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), name=f"kvemu-instance-{i}", daemon=True)
                   for i in range(n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except BaseException:
            stop.set()  # let every worker close its backend (and remove its tier file) first
            cancel_all()  # and end the C calls they are in (a slow tier's batch can take minutes)
            for t in threads:
                t.join()
            raise
    if errors:
        raise errors[0]
    if raw is not None:
        raw.append((state, stats, max(prepare_s), ends))
    return backend_outcome(state, stats, max(prepare_s), end_ns=ends if body is not None else None)


class BackendStats(NamedTuple):
    """One backend context's statistics after its replay."""

    ops: dict        # op -> Backend.op_stats
    facts: dict      # Backend.describe
    datapath: dict   # op -> Backend.datapath_stats
    timeline: dict   # Backend.timeline


def backend_stats(backend) -> BackendStats:
    return BackendStats({op: backend.op_stats(op) for op in OPS}, backend.describe(),
                        {op: backend.datapath_stats(op) for op in OPS}, backend.timeline())


def _merge_stats(main: BackendStats, extra: BackendStats | None) -> BackendStats:
    """An instance's backend statistics with those of its load stream (same tier, second context)
    added: op and data-path totals summed; facts and timeline the main context's."""
    if extra is None:
        return main
    ops = {op: {k: (main.ops[op][k] + extra.ops[op][k]) for k in main.ops[op]} for op in OPS}
    datapath = {op: {k: main.datapath[op][k] + extra.datapath[op][k] for k in main.datapath[op]} for op in OPS}
    return BackendStats(ops, main.facts, datapath, main.timeline)


def open_configured(spec: str, geometry: tuple, emulate_missing: bool, warn, timing: dict):
    """A backend opened, prepared and given its data path timing; and what the results say of it."""
    backend, requested, because = _open_backend(spec, geometry, emulate_missing, warn)
    try:
        lat, lat_from = _tier_latency(backend)
        link = effective_link(timing["link"], backend.profile)
        staged = is_staged(backend.kind, backend.profile)
        t = link.timing(tier_latency_ns=lat, store_mode=timing["store_mode"],
                        store_inflight_bytes=timing["store_inflight_bytes"], staged=staged)
        backend.set_timing(**t)
    except BaseException:
        backend.close()
        raise
    return backend, {"spec": backend.spec, "requested": requested, "because": because, "timing": t,
                     "latency": lat, "latency_from": lat_from, "link": link, "staged": bool(t["staged"]),
                     "profile": backend.profile}


def _open_backend(spec: str, geometry: tuple, emulate_missing: bool, warn):
    """(prepared backend, spec requested, why it was substituted or None)."""
    try:
        return _prepared(spec, geometry), spec, None
    except BackendUnavailable as e:
        substitute = counterpart_spec(spec) if emulate_missing else None
        if substitute is None:
            raise
        because = str(e)
    warn(f"backend {spec} is unavailable here ({because}); replaying its emulated counterpart {substitute} "
         f"instead: results are emulated, not measured")
    return _prepared(substitute, geometry), spec, because


def _prepared(spec: str, geometry: tuple):
    """A backend opened and prepared, or closed again if preparing it fails."""
    backend = Backend(spec)
    try:
        backend.prepare(*geometry)
    except BaseException:
        backend.close()
        raise
    return backend


def open_load_stream(backend, attach: bool):
    """A second context on ``backend``'s tier, with a timeline of its own (async loads): attached to
    its arena, or (not ``attach``) a context of its own on the same file (a uring ring)."""
    if backend.kind.store:  # a context of its own would be a second store, holding none of the first's objects
        raise ConfigError(f"{backend.name}: --kv-load async is not supported on a store yet; use in-step")
    lb = Backend(instance_spec(backend.spec, 0, "shared", True))
    try:
        if not attach:
            g = backend.geometry
            lb.prepare(g["block_bytes"], g["n_slots"], g["n_layers_model"], g["n_layers_replay"], bool(g["overlap"]),
                       g["chunk_blocks"], "cross-layer" if g["layout"] else "per-layer")
        else:
            lb.attach(backend)
        lb.set_timing(**backend.timing)
    except BaseException:
        lb.close()
        raise
    return lb


def floor_warning(spec: str, facts: dict) -> str | None:
    """A line saying how many accesses an emulated tier made at this host's speed, not its profile's."""
    hits, n = facts.get("floor_hits") or 0, facts.get("accesses") or 0
    if not hits:
        return None
    prof = facts.get("profile", {})
    floor = facts.get("floor_ns")
    floor_text = f"; this host takes {floor / 1000:.2f} us per access on its own" if floor else ""
    return (f"{spec}: {hits} of {n} accesses ({100 * hits / n:.1f}%) took longer on this host than profile "
            f"'{prof.get('name')}' allows ({prof.get('latency_ns')} ns, {prof.get('bandwidth_gbps')} GB/s){floor_text}; "
            f"their times are this host's, so those results are slower than the tier (backend.facts.floor_hits)")
