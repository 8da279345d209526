"""The replay's flow, one stage a function: the trace read and the requests selected; the
schedule chosen (:class:`RecordedSchedule` or :class:`ClosedSchedule`, the only place the two
differ); the step span and the arena planned; the instances run; the results written with the
metadata that :mod:`.describe` builds from each stage's piece. Repetitions (``output.repeat``) and
runs into a results dataset (``output.dataset``) wrap one replay.

The entry point is :func:`replay` (``kvemu.replay``); its options are
:class:`kvemu.replay_options.ReplayOptions`.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import jsontext, metrics
from ..analysis import TOTAL_COLUMNS, add_entry_totals, load_line, timing_from_meta
from ..arguments import callable_arg, instance_arg, path_arg
from ..backend_spec import BackendSpec, emulated_backend_args
from ..bounds import DEFAULT_TIER_EVICTION, tier_eviction_problem
from ..engine.weights import weights_from_meta
from ..models import geometry_from_meta
from ..figures import VIRTUAL_FACTS_MODE
from ..errors import ConfigError, OptionError, TraceError
from ..integrity import READ_OPTIONS, write_results
from ..links import get_link, is_storage, spread_over_gpus
from ..output import atomic_output, check_destination, check_written_files, make_folders, remove_empty_folders
from ..prices import load_prices
from ..schema import METADATA_KEY, iter_entries, read_header, read_trace
from . import describe
from .accumulate import Accumulator, TierMap, request_rows, write_rows
from .arena import (block_tokens_of, check_arena_fits, chunk_tokens_of, geometry_warning, layer_plan, layout_of,
                    provisioned_bytes, tier_capacity_of, tier_slots, touched_blocks)
from .dataset import dataset_path
from .layerkv import LayerPlan, group_moves, min_slots, plan_layers
from .host import host_load as describe_host_load, load_sample, load_warning
from .instances import floor_warning, instance_views, raise_fd_limit, run_instances
from ..replay_options import DEFAULT_MAX_MEMORY, MAX_INSTANCES, MAX_REPEAT, SHARING, ReplayOptions
from ..sessions import Release, graph_from_meta
from ..stackrules import first_counted
from .stack import LowerLevels, stack_section
from .closed import (chunk_keys, closed_body, closed_totals, engine_inputs, replayed_load, schedule_source,
                     time_scale_of)
from .closed.disagg import handoff_engine, run_disagg
from .weights import WeightStream, weights_label

__all__ = ["DEFAULT_MAX_MEMORY", "MAX_INSTANCES", "MAX_REPEAT", "Results", "SHARING", "replay"]


class Results(Mapping):
    """What a replay wrote: ``path`` (the results file, Parquet) and ``meta`` (its metadata,
    docs/replay.md "Results"). Read-only mapping of the metadata too (``results["figures"]``), with
    ``results["results_path"]`` the path; :meth:`table` reads the per-request rows."""

    def __init__(self, path, meta: dict):
        self.path = Path(path)
        self.meta = meta
        self._items = {**meta, "results_path": str(path)}

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<Results {self.meta.get('label')!r} at {str(self.path)!r}>"

    @property
    def label(self) -> str:
        return self.meta["label"]

    def table(self) -> pa.Table:
        """The per-request rows (one row per selected request: TTFT, TPOT, ITL, KV times, ...)."""
        return pq.read_table(self.path, **READ_OPTIONS)


def replay(trace, backend: BackendSpec | str, options: ReplayOptions | None = None, *, out=None,
           progress=None, warn=None) -> Results:
    """Replays ``trace`` (a trace file's path) on ``backend`` (a :class:`BackendSpec` or its text,
    such as ``"dram"`` or ``"vemu:cxl-pool"``) and writes the results to ``out`` (or, with
    ``options.output.dataset``, into that results dataset). ``options``: :class:`ReplayOptions`
    (default: the command line's defaults). ``progress(done, total)`` is called as steps
    complete; ``warn(message)`` for each warning as it arises (they are in the results too).

    With ``options.output.repeat`` N > 1 the trace is replayed N times from scratch and the
    results are the repetition with the median median-TTFT; their ``repetitions`` hold every
    repetition's figures."""
    path_arg("trace", trace)
    path_arg("out", out, optional=True)
    callable_arg("progress", progress)
    callable_arg("warn", warn)
    opts = (ReplayOptions() if options is None else instance_arg("options", options, ReplayOptions)).check()
    spec = BackendSpec.parse(backend)
    stack = opts.tier.stack
    if stack is not None:  # the stack's top level is the replay's backend and arena
        top = BackendSpec.parse(stack.levels[0].backend)
        if spec != top:
            raise ConfigError(f"the backend ({spec.text()}) is not the stack's top level ({top.text()}): "
                              f"with a stack, give the backend in the stack only")
        # the top level's sharing decides the instances' (its arena is shared or one per instance);
        # private levels come first, so a shared top means every level is shared
        shared = stack.levels[0].sharing == "shared"
        opts = opts.but(tier__capacity_bytes=stack.levels[0].capacity_bytes,
                        instances__sharing="shared" if shared else "replicated")
    if opts.tier.devices is not None and not spec.kind.lockstep and not opts.tier.emulate_missing:
        # an option the backend does not use is refused, not ignored
        raise OptionError("tier.devices", f"is for an emulated or virtual tier (the devices of its profile that "
                                          f"the instances queue on); {spec.short()} is measured on this host's "
                                          f"own devices")
    opts = _deployment(trace, opts)
    if opts.disagg.enabled:  # P prefill and D decode instances, each an accumulator (replay.closed.disagg)

        d = opts.disagg
        handoff_engine(d)  # a hand-off's transfer engine is refused before anything runs
        # one arena for every instance; the engine-side tiers are the pool's or each instance's own
        opts = opts.but(instances__count=d.prefill_instances + d.decode_instances, instances__sharing="shared")
    o = opts.output
    if o.dataset is None:
        if out is None:
            raise ConfigError("an output is needed: --out FILE or --dataset DIR")
        return _repetitions(trace, spec, out, opts, progress, warn)
    if out is not None:
        raise ConfigError("give either --out or --dataset, not both")
    run_id = o.run_id or uuid.uuid4().hex[:12]
    out = dataset_path(o.dataset, spec.text(), run_id)
    created = make_folders(out.parent)  # made for this run and removed again if it writes nothing
    try:
        return _repetitions(trace, spec, out, opts.but(output__run_id=run_id), progress, warn)
    except BaseException:
        remove_empty_folders(created)
        raise


def _deployment(trace, opts: ReplayOptions) -> ReplayOptions:
    """``opts`` with the deployment it replays: each disaggregation field not given is the trace's
    recorded deployment's (metadata ``deployment``, `kvemu record --prefill-instances`), else its
    default (DisaggOptions.resolve). A deployment taken from the trace that the other options
    cannot replay is refused naming the way out, ``{disagg.colocated}``."""
    d = opts.disagg
    recorded = None
    if not d.colocated:
        try:
            header = read_header(trace)
        except (TraceError, OSError, TypeError, ValueError):
            header = None  # the trace is refused, with its own message, where the replay reads it
        if header is not None:
            recorded = header.meta.get("deployment")
            header.close()
    resolved = d.resolve(recorded if isinstance(recorded, dict) else None)
    if resolved == d:
        return opts
    out = opts.but(disagg=resolved)
    if recorded and resolved.enabled and d.prefill_instances is None:  # the trace's instances
        try:
            out.check()
        except OptionError as e:
            raise OptionError(e.field, f"{e.reason} (the trace is recorded for {recorded['prefill_instances']} "
                                       f"prefill + {recorded['decode_instances']} decode instances, its "
                                       f"metadata's deployment; {{disagg.colocated}} replays it colocated)") from None
    return out


def _check_tier_files(trace_path, spec: BackendSpec, opts: ReplayOptions, out) -> None:
    """No tier file (the backend's, a stack level's, an instance's PATH.i) is an input or an output
    of the replay: a tier with size=existing would write into it (output.check_written_files)."""
    stack = opts.tier.stack
    specs = [BackendSpec.parse(lv.backend) for lv in stack.levels] if stack is not None else [spec]
    written = stack.files_written() if stack is not None else [(spec.name, f) for f in spec.files_written()]
    # the inputs other than the tiers' own files (a tier reads its own file: that is no conflict)
    inputs = [trace_path, *([opts.cost.prices] if opts.cost.prices else []),
              *([stack.source] if stack is not None and stack.source else []),
              *(f for s in {spec, *specs} if s.kind.target != "path" for f in s.files_read())]
    outputs = [out, opts.output.dataset] if opts.output.dataset else [out]
    check_written_files(written, inputs=inputs, outputs=outputs)


def _repetitions(trace_path, spec: BackendSpec, out, opts: ReplayOptions, progress, warn) -> Results:
    repeat, force = opts.output.repeat, opts.output.force
    if repeat == 1:
        return _Replay(trace_path, spec, out, opts, progress, warn).run()

    read = [trace_path, *spec.files_read(), *([opts.cost.prices] if opts.cost.prices else []),
            *(opts.tier.stack.files_read() if opts.tier.stack is not None else [])]
    check_destination(out, force, inputs=read)
    _check_tier_files(trace_path, spec, opts, out)
    folder = os.path.dirname(os.path.abspath(out))
    temps, figures = [], []
    once = opts.but(output__force=False, output__repeat=1)
    header = read_header(trace_path)  # every repetition replays (and hashes) the file opened here
    try:
        for i in range(repeat):
            fd, tmp = tempfile.mkstemp(prefix=f".kvemu-rep{i}-", suffix=".parquet", dir=folder)
            os.close(fd)
            os.unlink(tmp)
            temps.append(tmp)
            res = _Replay(trace_path, spec, tmp, once, progress, warn, header).run()
            figures.append(metrics.repetition_figures(res.table(), res.meta))
        ttft = [f["median_ttft_ms"] for f in figures]
        chosen = int(np.argsort(ttft, kind="stable")[(len(ttft) - 1) // 2])
        table = pq.read_table(temps[chosen], **READ_OPTIONS)
        meta = json.loads(table.schema.metadata[METADATA_KEY])
        meta["repetitions"] = {"n": repeat, "chosen": chosen, "rule": "the repetition with the median median TTFT",
                               "runs": figures}
        with atomic_output(out, force=force, inputs=read) as dst:
            write_results(dst, table, {METADATA_KEY: jsontext.dumps(meta, f"{out}: results metadata",
                                                                    sort_keys=True).encode()})
    finally:
        header.close()
        for t in temps:
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
    return Results(out, meta)


# ------------------------------------------------------------------------------------- stages
@dataclass
class Span:
    """The steps a replay runs and the requests it involves: steps ``s0..s1`` of the trace (or
    of the engine, in closed loop), ``involved`` the requests whose KV traffic loads the tier,
    ``selected`` those whose metrics are reported."""

    s0: int
    s1: int
    selected: np.ndarray
    involved: np.ndarray
    totals: dict
    #: steps the replay runs: s1 - s0 + 1 of a recorded span; in closed loop, before the run, the
    #: selected requests' recorded span (the progress total), after it the engine's steps
    n_steps: int


@dataclass
class Transfer:
    """The unit and shape KV moves in (datapath options resolved against the trace)."""

    layout: str
    layout_from: str
    first_layers: list
    span: np.ndarray
    block_tokens: int
    chunk_tokens: int
    chunk_from: str
    block_bytes: int
    n_layers: int
    #: what each replayed layer caches (layerkv.LayerKV), None: full attention in every layer
    kv_layers: tuple | None = None

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def slot_bytes(self) -> int:
        return self.chunk_blocks * len(self.span) * self.block_bytes


@dataclass
class Arena:
    """The tier arena of every instance: views (its slots, who owns it), the tier's capacity in
    chunks and where it came from, the LRU slots of a tier smaller than what the replay touches."""

    views: list
    capacity: int | None
    capacity_from: str
    tier_slots: list | None
    key_of: np.ndarray | None
    off_of: np.ndarray | None
    touched: np.ndarray
    w_blocks: int = 0

    @property
    def owned_slots(self) -> list[int]:
        return [v["n_slots"] for v in self.views if v["owns_arena"]]


def tier_eviction_of(meta: dict, opts: ReplayOptions) -> str:
    """What the replay's tier evicts (the arena's slots, closed loop's engine tier): ``--tier-eviction``
    if given, checked against the trace by record's rule (bounds.tier_eviction_problem), else the
    trace's ``engine.tier_eviction``, else lru (traces before it)."""
    eng = meta.get("engine", {})
    given = opts.tier.eviction
    if given is None:
        return eng.get("tier_eviction") or DEFAULT_TIER_EVICTION
    why = tier_eviction_problem(given, eng.get("tier_policy", "offload"),
                                opts.tier.capacity_bytes is not None or eng.get("tier_capacity_blocks") is not None,
                                policy_field="a trace recorded with --tier-policy",
                                capacity_field="{tier.capacity_bytes} or a trace recorded with --tier-capacity-gib")
    if why:
        raise OptionError("tier.eviction", why)
    return given


class RecordedSchedule:
    """The trace's own steps, the timeline stretched by the tier's times; requests spread over the
    instances round-robin (request i on instance i mod N)."""

    name = "recorded"

    def __init__(self, trace, opts: ReplayOptions):
        self.trace = trace
        self.n = opts.instances.count
        self.stats = None

    def span(self, sel: Span) -> Span:
        return sel

    def touched(self, sel: Span, n: int, chunk_blocks: int):
        return touched_blocks(self.trace, sel.s0, sel.s1, n, chunk_blocks)

    def selected_of(self, sel: Span, i: int) -> np.ndarray:
        return sel.selected & (np.arange(self.trace.n_requests) % self.n == i)

    def prepare(self, accs, warn) -> None:
        if self.n == 1:
            return
        # a recorded step is one GPU's batch: each instance computes only its own requests' entries
        meta = self.trace.header.meta
        try:
            model = (timing_from_meta(meta), meta.get("engine", {}).get("tier_policy") == "resident")
        except TraceError:
            model = None
            warn("the trace has no GPU compute model: each instance is charged the whole recorded step's compute")
        for acc in accs:
            acc.compute_model = model

    def run(self, ctx: _Replay, accs) -> dict:
        return run_instances(ctx.arena.views, accs, self.trace, ctx.sel.s0, ctx.sel.s1, ctx.spec_text,
                             ctx.geometry, ctx.xfer.block_bytes, ctx.opts.tier.emulate_missing, ctx.warn,
                             ctx.progress, ctx.sel.n_steps, ctx.timing)

    def resident_blocks(self) -> int | None:
        return None  # the arena's slots: every block the recorded steps touch has one

    def after(self, sel: Span, accs, touched) -> tuple[Span, np.ndarray]:
        return sel, touched


class ClosedSchedule:
    """The engine model schedules again (replay.closed): each step planned from the state the
    tier's KV times produced; every request before the selected ones runs first (their history)."""

    name = "closed"

    def __init__(self, trace, opts: ReplayOptions, time_scale: float, session_arrivals: bool = False):
        self.trace, self.opts = trace, opts
        self.inputs = engine_inputs(trace, time_scale)
        eviction = tier_eviction_of(trace.header.meta, opts)
        if eviction != self.inputs.cfg.tier_eviction:  # --tier-eviction: the replayed engine's tier evicts by it
            self.inputs = replace(self.inputs, cfg=replace(self.inputs.cfg, tier_eviction=eviction))
        self.time_scale = time_scale
        # --arrivals session on a trace with sessions: each follow-up released when its parent completes
        self.release = None
        if session_arrivals:
            graph = graph_from_meta(trace.header.meta.get("sessions"), trace.n_requests)
            if graph is not None:
                self.release = Release(graph, self.inputs.arrival_ns, time_scale)
        self.stats = None
        self.router = None
        self.disagg = None  # per request, the disaggregated deployment's columns (closed.disagg)

    def span(self, sel: Span) -> Span:
        # The engine replans from the first request; the tier may hold the blocks of every request that
        # arrives before the selected ones finished in the recorded run (a slower tier lets more in: the
        # arena's LRU takes them).
        tr = self.trace
        recorded_end = int(tr.start_ns[sel.s1] + tr.compute_ns[sel.s1])
        involved = self.inputs.arrival_ns <= max(recorded_end * self.time_scale,
                                                 int(self.inputs.arrival_ns[sel.selected].max()))
        if self.release is not None:  # a faster tier releases later turns sooner: any may run
            involved = np.ones_like(involved)
        return Span(0, sel.s1, sel.selected, involved, sel.totals, sel.n_steps)

    def touched(self, sel: Span, n: int, chunk_blocks: int):
        key_of, off_of, may_hold = chunk_keys(self.inputs, chunk_blocks, sel.involved)
        return np.broadcast_to(may_hold, (n, len(may_hold))), key_of, off_of  # any instance may be routed any

    def selected_of(self, sel: Span, i: int) -> np.ndarray:
        return sel.selected

    def prepare(self, accs, warn) -> None:
        id_space = self.trace.header.meta["blocks"]["id_space"]
        for acc in accs:
            acc.touched = np.zeros(id_space, bool)

    def run(self, ctx: _Replay, accs) -> dict:
        o, spec = self.opts, ctx.spec
        if o.disagg.enabled:
            return run_disagg(self, ctx, accs)
        n, sharing = o.instances.count, o.instances.sharing
        lockstep = spec.kind.lockstep  # emulated and virtual tiers: steps taken in timeline order
        tier_gbps = None  # several instances sharing an emulated tier queue for its devices' bandwidth
        devices = o.tier.devices if o.tier.devices is not None else n
        if sharing == "replicated" and n > 1 and devices != n:
            raise OptionError("tier.devices", f"a replicated tier is one device per instance ({n}); "
                                              f"{devices} devices are for a shared tier")
        tier_devices = None
        if n > 1 and sharing == "shared" and lockstep:
            device_gbps = emulated_backend_args(spec)[0].bandwidth_gbps
            tier_gbps = devices * device_gbps
            tier_devices = {"devices": devices, "device_gbps": device_gbps, "gbps": tier_gbps,
                            "from": "--tier-devices" if o.tier.devices is not None else "one per instance"}
        block_all = ctx.xfer.block_bytes * ctx.xfer.n_layers
        tier_chunks = self._bound_tier(ctx.arena, block_all)
        body, self.stats, self.router = closed_body(
            self.inputs, accs, ctx.sel.selected, n, sharing, o.schedule.routing, block_all,
            lockstep=lockstep, tier_gbps=tier_gbps, async_loads=o.schedule.kv_load == "async",
            tier_chunks=tier_chunks, chunk_blocks=ctx.xfer.chunk_blocks, stack=o.tier.stack,
            open_lower=None if o.tier.stack is None else (lambda: self._open_lower(ctx)), release=self.release)
        router = self.router
        outcome = run_instances(ctx.arena.views, accs, self.trace, ctx.sel.s0, ctx.sel.s1, ctx.spec_text,
                                ctx.geometry, ctx.xfer.block_bytes, o.tier.emulate_missing, ctx.warn, ctx.progress,
                                ctx.sel.n_steps, ctx.timing, body=body,
                                on_error=None if router is None else router.fail)
        self.stats = closed_totals(self.stats, router, self.inputs)
        if self.release is not None:  # the requests arrived when they were released
            released = self.release.arrival_ns
            ran = released >= 0
            ctx.arrival_ns = np.where(ran, released, ctx.arrival_ns)
            ctx.arrival_ms = np.where(ran, released / 1e6, ctx.arrival_ms)
        if "stack" in self.stats:
            self.stats["stack"] = stack_section(self.stats["stack"], block_all, self.inputs.cfg.tokens_per_block)
        if tier_devices is not None:
            self.stats["tier_devices"] = tier_devices
        return outcome

    def _open_lower(self, ctx):
        """An instance's contexts for the stack's levels below the top (replay.stack.LowerLevels)."""
        o, x = self.opts, ctx.xfer
        chunk_all = x.chunk_blocks * x.block_bytes * x.n_layers
        caps = [max(1, lv.capacity_bytes // chunk_all) for lv in o.tier.stack.levels]
        need = 0 if x.kv_layers is None else min_slots(x.kv_layers, x.block_bytes)  # a linear layer's state
        return LowerLevels(o.tier.stack, x.block_bytes, ctx.geometry, caps, x.chunk_blocks, o.tier.max_memory_bytes,
                           o.tier.emulate_missing, ctx.warn, ctx.timing, x.span,
                           -(-need // x.chunk_blocks) * x.chunk_blocks)

    def _bound_tier(self, arena: Arena, block_all_layers: int) -> int | None:
        """A ``--tier-capacity`` bounds the replayed engine's tier, not only the arena: under offload
        the engine's tier holds the arena's chunks (returned; they are evicted whole, LRU), under
        resident its block pool holds as many blocks as the capacity's bytes; a prefix evicted from
        it is a miss the engine recomputes. None: the tier as recorded."""
        cfg = self.inputs.cfg
        if arena.capacity_from != "--tier-capacity" or cfg.tier_policy == "none":
            return None
        blocks = max(1, self.opts.tier.capacity_bytes // block_all_layers)
        self.inputs = replace(self.inputs, cfg=replace(cfg, tier_capacity_blocks=blocks))
        return arena.capacity if cfg.tier_policy == "offload" else None

    def resident_blocks(self) -> int | None:
        """The most blocks the replayed engines' tiers held at once (summed over the distinct tiers)."""
        return None if self.stats is None else int(self.stats["tier_peak_blocks"])

    def after(self, sel: Span, accs, touched) -> tuple[Span, np.ndarray]:
        """The span the engine ran, and what it touched (the replayed engine's own, not the recording's)."""
        if self.router is not None:
            for i, acc in enumerate(accs):
                acc.selected = sel.selected & (self.router.owner == i)
        steps = self.stats["steps"]
        involved = np.logical_or.reduce([acc.first_start < np.iinfo(np.int64).max for acc in accs])
        touched = np.stack([acc.touched for acc in accs]) if len(accs) > 1 else accs[0].touched[None, :]
        return Span(sel.s0, steps - 1, sel.selected, involved, sel.totals, steps), touched


class _Replay:
    """One replay, stage by stage (run()); each stage leaves its piece for the results."""

    def __init__(self, trace_path, spec: BackendSpec, out, opts: ReplayOptions, progress, warn, header=None):
        self.trace_path, self.out, self.opts, self.progress = trace_path, out, opts, progress
        self.header = header  # the trace as opened by the caller (repetitions), else opened here
        n = opts.instances.count
        if n > 1 and spec.kind.workers and not spec.has_option("workers"):
            # one thread per instance, as a GPU per instance: pools of several would pin every instance's
            # replaying thread to the same first CPU
            spec = spec.with_option("workers", 1)
        self.spec = spec
        self.spec_text = spec.text()
        self.run_id = opts.output.run_id or uuid.uuid4().hex[:12]
        self.warnings: list[str] = []
        self.pending_warning: str | None = None
        self._lock = threading.Lock()
        self._user_warn = warn

    def warn(self, message: str) -> None:
        with self._lock:
            self.warnings.append(message)
            if self._user_warn is not None:
                self._user_warn(message)

    # -- the flow
    def run(self) -> Results:
        o = self.opts

        # read before anything runs: a bad price table is refused in one line, and no output replaces it
        self.prices = load_prices(o.cost.prices)
        inputs = [self.trace_path, *self.spec.files_read(), *([o.cost.prices] if o.cost.prices else []),
                  *(o.tier.stack.files_read() if o.tier.stack is not None else [])]
        link = get_link(o.datapath.link)
        check_destination(self.out, o.output.force, inputs=inputs)
        _check_tier_files(self.trace_path, self.spec, o, self.out)
        raise_fd_limit(o.instances.count)
        wall0 = time.perf_counter()
        self.trace = trace = read_trace(self.trace_path if self.header is None else self.header)
        h = trace.header
        # a tensor-parallel instance's GPUs each move their share of the KV over their own host link
        self.link_lanes = _kv_links(h.meta, h.path)
        self.link = link.with_lanes(self.link_lanes)
        self._check_reads_in_place(h.meta.get("engine", {}).get("tier_policy"))
        self.eviction = tier_eviction_of(h.meta, o)
        self.schedule = self._schedule()
        sel = self.schedule.span(self._span())
        self.xfer = self._transfer()
        why = geometry_warning(h.meta, self.xfer.layout)
        if why:  # what replay still does not move as the engine would
            self.warn(why)
        self.arena = self._arena(sel)
        self.sel = sel
        self.placement, overlap = self._weights()
        self.overlap = overlap
        arena_bytes = sum(self.arena.owned_slots) * len(self.xfer.span) * self.xfer.block_bytes
        check_arena_fits(self.spec_text, arena_bytes, sum(self.arena.owned_slots), len(self.xfer.span),
                         self.xfer.block_bytes, o.tier.max_memory_bytes)
        if self.pending_warning:
            self.warn(self.pending_warning)
        accs = self._accumulators(sel)
        self.timing = {"link": self.link, "store_mode": o.stores.timing,
                       "store_inflight_bytes": o.stores.inflight_bytes}
        x = self.xfer
        self.geometry = (x.n_layers, len(x.span), overlap, x.chunk_blocks, x.layout)
        try:
            load0 = load_sample()
            outcome = self.schedule.run(self, accs)
            host_load = describe_host_load(load0, load_sample())
            if outcome.mode != VIRTUAL_FACTS_MODE:  # virtual time does not depend on this host
                line = load_warning(host_load, f"the {outcome.spec} replay")
                if line:
                    self.warn(line)
            sel, touched = self.schedule.after(sel, accs, self.arena.touched)
            self._outcome_warnings(outcome, accs)
            disagg = getattr(self.schedule, "disagg", None)
            rows, duration_s = _rows(trace, accs, self.arrival_ns, self.arrival_ms, x.block_bytes * x.n_layers,
                                     o.instances.count if disagg is None else 1)
            if disagg is not None:
                ids = rows["request_id"].to_numpy().astype(np.int64)
                for name, col in disagg.items():
                    rows = rows.append_column(name, pa.array(col[ids]))
            rows = _session_columns(rows, h.meta.get("sessions"))
            load = replayed_load(accs, sel.selected, self.arrival_ns, h)
            if load is not None and load["overloaded"]:
                self.warn(load_line(load))
            meta = describe.results_meta(
                run=describe.RunPiece(self.run_id, self._label(outcome.spec), duration_s,
                                      round(time.perf_counter() - wall0, 3), round(outcome.prepare_s, 3)),
                backend=outcome, warnings=self.warnings,
                # the hash of what was replayed: through the descriptor every read went through
                trace=describe.TracePiece(self.trace_path, trace, sel.totals, h.sha256()),
                load=load, schedule=self._schedule_piece(), params=self._params_piece(sel, arena_bytes),
                tier=describe.TierPiece(touched, o.instances.count, len(x.span) * x.block_bytes,
                                        self.arena.owned_slots, self.arena.capacity, self.arena.capacity_from,
                                        x.chunk_blocks * x.n_layers * x.block_bytes, self.arena.tier_slots,
                                        sum(acc.load_misses for acc in accs), self.schedule.resident_blocks(),
                                        provisioned_bytes(h, o.tier.capacity_bytes, self.arena.capacity,
                                                          self.arena.capacity_from,
                                                          x.chunk_blocks * x.n_layers * x.block_bytes,
                                                          x.n_layers * x.block_bytes), self.eviction),
                steps=describe.StepsPiece.of(accs, sel.n_steps),
                datapath=describe.DatapathPiece(o.datapath.link, self.link, self.link_lanes, o.stores.timing,
                                                o.stores.inflight_bytes, overlap, x, outcome),
                instances=o.instances.count, closed_stats=self.schedule.stats,
                weights=None if self.placement is None else (self.placement, accs, self.arena.w_blocks, overlap,
                                                              sel.n_steps),
                host_load=host_load, cost=self._cost_piece(rows, outcome))
            with atomic_output(self.out, force=o.output.force, inputs=inputs) as tmp:
                write_rows(tmp, rows, accs, {METADATA_KEY: jsontext.dumps(meta, f"{self.out}: results metadata",
                                                                           sort_keys=True).encode()})
        finally:
            for acc in accs:
                acc.close()
            if self.header is None:
                h.close()
        return Results(self.out, meta)

    # -- stages
    def _schedule(self):
        o, trace = self.opts.schedule, self.trace
        src = schedule_source(trace.header.meta)
        self.sched_src = src
        if o.schedule is None:
            name, self.schedule_from = ("closed" if src["closed_loop"] else "recorded"), "default"
        else:
            name, self.schedule_from = o.schedule, "--schedule"
        closed = name == "closed"
        if self.opts.window.warmup and not closed:
            raise OptionError("window.warmup", "needs {schedule.schedule} closed: the recorded schedule replays only "
                                               "the counted requests' steps, so nothing before them warms the caches")
        if o.kv_load == "async" and not closed:
            raise OptionError("schedule.kv_load", "async needs {schedule.schedule} closed: the recorded schedule "
                                                  "loads where it was recorded")
        if self.opts.disagg.enabled and not closed:
            raise OptionError("disagg.prefill_instances", "needs {schedule.schedule} closed: roles are the replayed "
                                                          "engine's (the recorded schedule keeps its steps)")
        if o.routing != "round-robin" and not closed:
            raise OptionError("schedule.routing", "needs {schedule.schedule} closed: the recorded schedule spreads "
                                                  "requests round-robin")
        self.time_scale, self.load_from = time_scale_of(trace, o.time_scale, o.request_rate, closed)
        arrival_ms = trace.arrival_ms * self.time_scale if self.time_scale != 1.0 else trace.arrival_ms
        self.arrival_ms = arrival_ms
        self.arrival_ns = np.round(arrival_ms * 1e6).astype(np.int64)
        self.arrivals = self._arrivals(closed)
        if not closed:
            return RecordedSchedule(trace, self.opts)
        return ClosedSchedule(trace, self.opts, self.time_scale, self.arrivals["ran"] == "session")

    def _arrivals(self, closed: bool) -> dict:
        """When session requests arrive (``--arrivals``, docs/replay.md): ``session`` by default for a
        trace with sessions replayed closed loop on one instance, ``recorded`` otherwise."""
        o, meta = self.opts, self.trace.header.meta
        has = meta.get("sessions") is not None
        one = o.instances.count == 1 and not o.disagg.enabled
        if o.schedule.arrivals is None:
            ran = "session" if has and closed and one else "recorded"
            why = ("default: a trace with sessions, closed loop, one instance" if ran == "session" else
                   "default: the trace has no sessions" if not has else
                   "default: session arrivals are replayed closed loop on one instance only")
        else:
            if o.schedule.arrivals == "session" and not closed:
                raise OptionError("schedule.arrivals", "session needs {schedule.schedule} closed: the recorded "
                                                       "schedule keeps its steps")
            ran, why = o.schedule.arrivals, "--arrivals"
        return {"ran": ran, "from": why, "sessions": has}

    def _span(self) -> Span:
        """Pass 1 over the entries: the step range the selected requests span (every entry passes the
        checks `trace validate` runs, and this full pass verifies their content digest: nothing below
        runs on entries the validator would refuse), and the trace summary's entry totals."""
        trace, w = self.trace, self.opts.window
        selected = _select_requests(trace, w.requests, w.arrival_ms, w.warmup)
        first_step = np.full(trace.n_requests, np.iinfo(np.int64).max)
        last_step = np.full(trace.n_requests, -1, np.int64)
        totals: dict = {}
        for e in iter_entries(trace, columns=("step", "request_id", *TOTAL_COLUMNS)):
            # indices and values in the targets' own types: ufunc.at's fast path (25x over int32 here)
            rid, step = e["request_id"].astype(np.intp), e["step"].astype(np.int64)
            np.minimum.at(first_step, rid, step)
            np.maximum.at(last_step, rid, step)
            add_entry_totals(totals, e)
        if np.any(last_step[selected] < 0):
            raise ConfigError("some selected requests never run in this trace (incomplete trace?)")
        s0, s1 = int(first_step[selected].min()), int(last_step[selected].max())
        # Every request running in that span is replayed (its KV traffic loads the tier); metrics are
        # reported for the selected requests, whose steps all lie inside the span.
        involved = (first_step <= s1) & (last_step >= s0)
        return Span(s0, s1, selected, involved, totals, s1 - s0 + 1)

    def _transfer(self) -> Transfer:
        h, d, w = self.trace.header, self.opts.datapath, self.opts.window
        layout, layout_from = layout_of(h, d.layout)
        if layout == "cross-layer" and w.layers not in (None, h.layers):
            raise OptionError("datapath.layout", "cross-layer moves every layer of a chunk in one transfer: replay "
                                                 "all layers (no {window.layers}), or use per-layer")
        block_tokens = block_tokens_of(h)
        chunk_tokens, chunk_from = chunk_tokens_of(h, d.chunk_tokens, block_tokens)
        model = geometry_from_meta(h.model)
        if layout == "cross-layer" or model.uniform:
            # cross-layer copies move a block of every layer at once: full attention's geometry
            first_layers, span = layer_plan(h.layers, w.layers)
            return Transfer(layout, layout_from, first_layers, span, block_tokens, chunk_tokens, chunk_from,
                            h.block_bytes_per_layer, h.layers)
        plan = plan_layers(model, block_tokens, w.layers, h.block_bytes_per_layer)
        return Transfer(layout, layout_from, plan.first_layers, plan.span, block_tokens, chunk_tokens, chunk_from,
                        plan.block_bytes, h.layers, plan.layers)

    def _arena(self, sel: Span) -> Arena:
        """Pass 2: the blocks each instance touches, which sizes the arenas and maps ids to slots. The
        arena is the tier: as many chunks as the tier holds (given, recorded, or what --max-memory
        allows when the touched chunks do not fit), its slots reused least recently used first."""
        o, h, x, kind = self.opts, self.trace.header, self.xfer, self.spec.kind
        n = o.instances.count
        touched, key_of, off_of = self.schedule.touched(sel, n, x.chunk_blocks)
        views = instance_views(touched, n, o.instances.sharing, kind.virtual, key_of, off_of, x.chunk_blocks)
        # a linear layer's state lies inside its layer of the arena, however few chunks the tier holds
        need = 0 if x.kv_layers is None else -(-min_slots(x.kv_layers, x.block_bytes) // x.chunk_blocks) * x.chunk_blocks
        for v in views:
            v["n_slots"] = max(v["n_slots"], need)
        capacity, capacity_from = tier_capacity_of(h, o.tier.capacity_bytes, x.chunk_blocks, x.n_layers * x.block_bytes)
        needed = max(v["n_slots"] for v in views) // x.chunk_blocks
        # An arena in memory is bounded by --max-memory: a tier the user did not size (unbounded, or as
        # recorded) that needs more is replayed as one of what fits. A file tier is bounded by its disk
        # instead, and virtual time has no arena.
        fits = max(int(o.tier.max_memory_bytes // x.slot_bytes), 1) if kind.arena_in_memory else None
        want = needed if capacity is None else min(capacity, needed)
        if fits is not None and want > fits and capacity_from != "--tier-capacity":
            # said once the arena is known to fit (check_arena_fits), so a refusal is one line
            self.pending_warning = (f"the tier ({capacity_from}) needs a {want * x.slot_bytes / 2**30:.2f} GiB arena for the "
                      f"{needed} chunks this replay {'may touch' if self.schedule.name == 'closed' else 'touches'}; "
                      f"--max-memory allows {fits} ({fits * x.slot_bytes / 2**30:.2f} GiB), so the arena stands for "
                      f"a tier of that size and reuses the slots of what it evicts (LRU); give --tier-capacity or a "
                      f"larger --max-memory to change it")
            capacity, capacity_from = fits, "--max-memory"
        slots = None
        if capacity is not None and capacity < needed:
            key_space = int(h.meta["blocks"]["id_space"]) or 1
            origin = {"trace": "the trace's engine.tier_capacity_blocks"}.get(capacity_from, capacity_from)
            shared = tier_slots(self.eviction, capacity, key_space, origin) \
                if n == 1 or o.instances.sharing == "shared" else None
            slots = [shared or tier_slots(self.eviction, capacity, key_space, origin) for _ in range(n)]
            for v in views:
                v["n_slots"], v["slot_of"] = max(capacity * x.chunk_blocks, need), None
        return Arena(views, capacity, capacity_from, slots, key_of, off_of, touched)

    def _weights(self):
        """Weights in the tier (engine/weights.py): a weight region after the KV slots of every arena."""
        placement = weights_from_meta(self.trace.header.meta)
        overlap = self.opts.datapath.overlap
        if placement is None:
            return None, overlap
        x = self.xfer
        self.arena.w_blocks = WeightStream.region_blocks(placement, x.n_layers, x.block_bytes, x.chunk_blocks)
        for v in self.arena.views:
            v["weight_base"] = v["n_slots"]
            v["n_slots"] += self.arena.w_blocks
        # the engine prefetched weights a layer ahead: loads run in a fetch stream
        return placement, overlap or placement.stream == "overlap"

    def _accumulators(self, sel: Span) -> list:
        n, x, a = self.opts.instances.count, self.xfer, self.arena
        lru_lock = threading.Lock()
        accs = []
        for i in range(n):
            tier = None if a.tier_slots is None else TierMap(a.tier_slots[i], a.key_of, a.off_of, x.chunk_blocks,
                                                             lru_lock)
            accs.append(Accumulator(self.trace, sel.s0, sel.n_steps, self.schedule.selected_of(sel, i),
                                    a.views[i]["slot_of"], x.span, tier))
            accs[-1].kv = group_moves(self.trace, LayerPlan(x.first_layers, x.span, x.kv_layers, x.block_bytes))
        if self.placement is not None:
            for acc, v in zip(accs, a.views):
                acc.weights = WeightStream(self.placement, v["weight_base"], a.w_blocks, x.block_bytes, x.n_layers)
        self.schedule.prepare(accs, self.warn)
        return accs

    def _outcome_warnings(self, outcome, accs) -> None:
        for f in outcome.facts:
            floor = floor_warning(outcome.spec, f)
            if floor:
                self.warn(floor)
        overflow = describe.tier_overflow(self.arena.tier_slots)
        if overflow:
            origin = self.arena.tier_slots[0].origin
            why = (f"one engine step touches more chunks than the tier's {self.arena.capacity} ({origin}), so they "
                   f"evict one another in order and the tier keeps the last {self.arena.capacity}"
                   if self.eviction == DEFAULT_TIER_EVICTION else
                   f"under --tier-eviction {self.eviction} a chunk a call used may be evicted by the call's later "
                   f"chunks in the tier of {self.arena.capacity} ({origin})")
            self.warn(f"{overflow} chunks were evicted by the replay call that stored or loaded them: {why}; each is "
                      f"timed as it moves (tier.call_overflow_chunks)")
        misses = sum(acc.load_misses for acc in accs)
        if misses and self.schedule.name == "recorded":
            self.warn(f"{misses} block loads found their chunk evicted from the tier of {self.arena.capacity} chunks "
                      f"({self.arena.capacity_from}): the recorded engine found them in a larger tier, and the "
                      f"recorded schedule keeps its steps, so they are timed as loads and not recomputed "
                      f"(tier.load_misses_blocks; with --tier-capacity, --schedule closed recomputes what the tier "
                      f"evicted)")
        elif misses:
            self.warn(f"{misses} block loads found their chunk evicted from the arena of {self.arena.capacity} chunks "
                      f"({self.arena.capacity_from}) while the replayed engine's tier still held it; they are timed "
                      f"as loads (tier.load_misses_blocks)"
                      + ("" if self.arena.capacity_from == "--tier-capacity" else
                         "; give --tier-capacity to bound the engine's tier as the arena"))

    def _check_reads_in_place(self, policy) -> None:
        """Reads in place (``resident``) are loads from a tier mapped into the GPU's address space: a storage
        tier is refused. An emulated HBM tier at TP > 1 is every GPU's HBM: its bandwidth times the lanes."""
        if policy == "resident" and self.opts.tier.stack is not None:
            raise ConfigError("--tiers replays a stack of levels under an offload trace; this trace keeps its KV "
                              "resident in one tier (tier policy resident): replay it with --backend, or record "
                              "it with --tier-policy offload")
        kind = self.spec.kind
        profile = emulated_backend_args(self.spec)[0] if kind.emulated else None
        if policy == "resident" and is_storage(kind, profile):
            raise ConfigError(f"backend {self.spec.text()} is storage, reached by I/O; a resident trace reads "
                              f"its KV in place, which only memory and pool tiers mapped into the GPU's address "
                              f"space allow (replay an offload trace, or a memory tier)")
        spread = spread_over_gpus(profile, self.link_lanes)
        if spread is not None:
            self.spec = self.spec.with_option("bandwidth_gbps", repr(spread))
            self.spec_text = self.spec.text()

    def _label(self, spec_text: str) -> str:
        o = self.opts
        if o.output.label:
            return o.output.label

        policy = self.trace.header.meta.get("engine", {}).get("tier_policy")
        if o.tier.stack is not None:  # the label names the stack
            spec_text = f"[{o.tier.stack.label()} {o.tier.stack.placement}]"
        d = o.disagg
        if d.enabled:  # the deployment and its hand-off path
            spec_text = f"{spec_text}/pd{d.prefill_instances}x{d.decode_instances}-{d.path}"
            if d.decode_chunked_prefill == "off":
                spec_text += "-decode-unchunked"
        return (f"{spec_text}/{policy}{'' if self.eviction == DEFAULT_TIER_EVICTION else '-' + self.eviction}"
                f"{'+overlap' if self.overlap else ''}"
                f"{'' if o.datapath.link == describe.DEFAULT_LINK else '@' + o.datapath.link}"
                f"{'+serial-stores' if o.stores.timing == 'serial' else ''}"
                f"{weights_label(self.placement)}"
                # a trace with sessions replayed at its recorded times says so (session arrivals: unmarked)
                f"{'+recorded-arrivals' if self.arrivals['sessions'] and self.arrivals['ran'] == 'recorded' else ''}")

    def _schedule_piece(self) -> describe.SchedulePiece:
        return describe.SchedulePiece(self.schedule.name, self.schedule_from, self.sched_src, self.time_scale,
                                      self.load_from, self.schedule.stats, self.trace.header,
                                      self.opts.schedule.kv_load,
                                      self.arrivals if self.arrivals["sessions"] else None)

    def _cost_piece(self, rows, outcome) -> describe.CostPiece:
        gpu = self.trace.header.meta.get("gpu") or {}
        gpus = gpu.get("gpus", 1)
        return describe.CostPiece(self.prices, self.opts.cost.amortise_years, gpu.get("name"),
                                  gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1 else 1,
                                  rows.num_rows, int(np.asarray(rows["output_tokens"], np.int64).sum()),
                                  BackendSpec.parse(outcome.spec).priced_profile())

    def _params_piece(self, sel: Span, arena_bytes: int) -> describe.ParamsPiece:
        o, x = self.opts, self.xfer
        return describe.ParamsPiece(self.overlap, o.tier.max_memory_bytes, o.window.requests, o.window.arrival_ms,
                                    o.window.warmup,
                                    int(sel.selected.sum()), int(sel.involved.sum()), (sel.s0, sel.s1),
                                    x.first_layers, x.span.tolist(), x.n_layers, arena_bytes,
                                    sum(self.arena.owned_slots), o.instances.count, o.instances.sharing,
                                    None if x.kv_layers is None else [lk.kind for lk in x.kv_layers])


def _kv_links(meta: dict, path) -> int:
    """Host links a block's KV moves over in parallel (the trace's ``gpu.kv_links``: tensor-parallel
    ranks holding distinct KV heads, times pipeline stages); 1 for traces without it (recorded
    before parallelism was modelled, real runs)."""
    lanes = (meta.get("gpu") or {}).get("kv_links", 1)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 1 << 20:
        raise TraceError(f"{path}: gpu.kv_links must be a whole number from 1 to 2^20, "
                         f"got {lanes!r}")
    return lanes


def _select_requests(trace, request_range, arrival_range, warmup: float = 0.0) -> np.ndarray:
    sel = np.ones(trace.n_requests, bool)
    if warmup:  # the first requests in arrival order warm the caches and are not counted
        sel[:first_counted(warmup, trace.n_requests)] = False
    if request_range is not None:
        lo, hi = request_range
        sel &= (trace.request_id >= lo) & (trace.request_id < hi)
    if arrival_range is not None:
        lo, hi = arrival_range
        sel &= (trace.arrival_ms >= lo) & (trace.arrival_ms < hi)
    if not sel.any():
        raise ConfigError("the request window selects no request of this trace")
    return sel


def _session_columns(rows: pa.Table, sessions: dict | None) -> pa.Table:
    """The results rows with each request's session and turn (kvemu.sessions) after arrival_ms,
    for a trace with sessions."""
    if sessions is None:
        return rows
    ids = rows["request_id"].to_numpy().astype(np.int64)
    at = rows.column_names.index("arrival_ms") + 1
    for k, name in enumerate(("session_id", "turn")):
        rows = rows.add_column(at + k, name, pa.array(np.asarray(sessions["session" if k == 0 else "turn"],
                                                                 np.int64)[ids]))
    return rows


def _rows(trace, accs, arrival_ns, arrival_ms, block_all_layers: int, instances: int) -> tuple[pa.Table, float]:
    """The per-request rows of every instance's selected requests, in request order, and the run's
    duration (first arrival to last end: prices.priced_duration_s, the span its cost is priced over)."""
    from ..prices import priced_duration_s

    parts, ends, arrivals = [], [], []
    for i, acc in enumerate(accs):
        sel_idx = np.flatnonzero(acc.selected)
        if len(sel_idx) == 0:
            continue
        part, end_i = request_rows(trace, acc, sel_idx, arrival_ns, arrival_ms, block_all_layers)
        if instances > 1:
            part = part.append_column("instance", pa.array(np.full(len(sel_idx), i, np.int16)))
        parts.append(part)
        ends.append(end_i)
        arrivals.append(arrival_ns[sel_idx].min())
    rows = parts[0] if len(parts) == 1 else pa.concat_tables(parts).sort_by("request_id")
    return rows, priced_duration_s(arrivals, ends)

