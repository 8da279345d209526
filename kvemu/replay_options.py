"""What a replay can be told: :class:`ReplayOptions`, grouped as the replay uses them.

Every field is documented on its group; ``help(ReplayOptions)`` and an editor show them. The
defaults are the command line's (``kvemu replay -h``): the CLI builds these objects from its flags
and calls :func:`kvemu.replay`, so the command line can do nothing the API cannot. A bad value
raises :class:`kvemu.errors.OptionError` naming the field (``stores.timing``); the CLI names the
flag (``--store-timing``) instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from .bounds import DEFAULT_TIER_EVICTION, LAYOUTS, eviction_name_problem
from .deployment import DEFAULT_ROUTING, DEFAULT_TRANSFER, FIELDS as DEPLOYMENT_FIELDS, MAX_INSTANCES, ROUTING, \
    check_deployment
from .errors import ConfigError, OptionError
from .option_table import Opt, OptionGroups, declare, flag_map
from .prices import AMORTISE_YEARS_BOUNDS, DEFAULT_AMORTISE_YEARS
from .links import DEFAULT_LINK, DEFAULT_STORE_INFLIGHT_BYTES, DEFAULT_STORE_MODE, LINKS
from .policies import policy_names
from .stackrules import DEFAULT_PLACEMENT, PLACEMENTS, check_warmup
from .stackspec import StackSpec

#: Which schedule a replay runs (docs/replay.md): the engine model again, or the trace's steps.
SCHEDULES = ("closed", "recorded")
#: Where a prefix from the tier is loaded: inside the request's first prefill step, or asynchronously.
KV_LOADS = ("in-step", "async")
#: When a request of a session is released in closed loop (kvemu.sessions, docs/replay.md).
ARRIVALS = ("recorded", "session")
SHARING = ("shared", "replicated")
DEFAULT_MAX_MEMORY = 4 << 30
MAX_REPEAT = 100


def _one_of(name: str, value, allowed, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if value not in allowed:
        raise OptionError(name, f"must be one of {', '.join(allowed)}, got {value!r}")


def _whole(name: str, value, lo: int, hi: int, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise OptionError(name, f"must be a whole number from {lo} to {hi}{what}, got {value!r}")


def _range(name: str, value, number=float) -> None:
    if value is None:
        return
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
    if not ok or value[0] >= value[1] or (number is int and not all(float(x).is_integer() for x in value)):
        raise OptionError(name, f"must be a range (start, end) with start < end, got {value!r}")


@dataclass(frozen=True)
class ScheduleOptions:
    """Which schedule runs, and how requests arrive and are routed.

    - ``schedule``: ``closed`` (the engine model schedules again, each step from the state the
      tier's KV times produced), ``recorded`` (keep the trace's steps and stretch the timeline), or
      None: closed for traces kvemu's engine recorded (with any number of instances), recorded for
      real-run traces. ``--schedule``.
    - ``time_scale``: multiply arrival times by this (2 = half the load); closed loop. ``--time-scale``.
    - ``request_rate``: rescale arrivals to this mean rate in requests per second (as ``vllm bench
      serve --request-rate``); closed loop; not with ``time_scale``. ``--request-rate``.
    - ``routing``: how closed loop sends requests to instances: ``round-robin`` (default),
      ``least-loaded``, ``prefix-aware`` (Mooncake's conductor). ``--routing``.
    - ``kv_load``: ``in-step`` (default: a prefix from the tier is loaded inside the request's first
      prefill step, as recorded) or ``async`` (on a stream of its own while running requests go
      on, as vLLM's asynchronous KV loading); closed loop. ``--kv-load``.
    - ``arrivals``: ``session`` (a request that continues another is released when its parent
      completes plus the recorded gap) or ``recorded`` (every request at its recorded time); None:
      session for a trace with sessions replayed closed loop on one instance, recorded otherwise.
      ``--arrivals``.
    """

    schedule: str | None = None
    time_scale: float | None = None
    request_rate: float | None = None
    routing: str = "round-robin"
    kv_load: str = "in-step"
    arrivals: str | None = None

    def check(self) -> None:
        _check_declared("schedule", self)
        # time_scale and request_rate are checked against the trace's arrivals (recording.arrival_scale)


@dataclass(frozen=True)
class WindowOptions:
    """Which requests and layers are replayed (the reductions the results record).

    - ``requests``: replay request ids ``(start, end)``, end excluded, with their history: closed
      loop runs every earlier request first; recorded, co-batched requests are replayed too.
      ``--requests START:END``.
    - ``arrival_ms``: replay requests arriving in ``(start, end)`` ms. ``--arrival-ms``.
    - ``layers``: replay this many evenly spaced layers, each standing for its share of the model's
      layers; None: all. ``--layers``.
    - ``warmup``: share F (0 <= F < 1) of the trace's requests, in arrival order, that warm the
      caches and are not counted: requests ``0 .. floor(F x N) - 1`` run first (closed loop) and have
      no rows; the rule of ``analyze capacity --warmup`` (kvemu.stackrules.first_counted).
      ``--warmup``.
    """

    requests: tuple[int, int] | None = None
    arrival_ms: tuple[float, float] | None = None
    layers: int | None = None
    warmup: float = 0.0

    def check(self) -> None:
        try:  # analyze capacity's rule, the field named as the other fields are
            check_warmup(self.warmup, "{window.warmup}")
        except ConfigError as e:
            raise OptionError("window.warmup", str(e).removeprefix("{window.warmup} ")) from None
        _range("window.requests", self.requests, int)
        _range("window.arrival_ms", self.arrival_ms)
        _check_declared("window", self)


@dataclass(frozen=True)
class DataPathOptions:
    """How the GPU reaches the tier, and the unit KV moves in (docs/replay.md, "The data path").

    - ``link``: the GPU's link to the tier (kvemu.links: ``pcie5-x16`` by default, ``pcie4-x16``,
      ``nvlink-c2c``, ``cxl-x16``, or ``cpu`` for no link limit). ``--link``.
    - ``overlap``: pipeline KV loads with compute layer by layer. ``--overlap``.
    - ``chunk_tokens``: the transfer unit in tokens; None: the trace's, else 256 (LMCache's chunk).
      ``--chunk-tokens``.
    - ``layout``: ``per-layer`` or ``cross-layer`` (every layer of a chunk in one transfer); None:
      the trace's, else per-layer. ``--kv-layout``.
    """

    link: str = DEFAULT_LINK
    overlap: bool = False
    chunk_tokens: int | None = None
    layout: str | None = None

    def check(self) -> None:
        _check_declared("datapath", self)


@dataclass(frozen=True)
class StoreOptions:
    """How KV stores are timed.

    - ``timing``: ``async`` (default: stores overlap later compute, as vLLM's and LMCache's
      offloading, stalling past ``inflight_bytes`` in flight) or ``serial`` (on each step's
      critical path). ``--store-timing``.
    - ``inflight_bytes``: with async stores, bytes in flight before a step stalls (default 2 GiB,
      an estimate of an offloading connector's host staging buffer). ``--store-inflight``.
    """

    timing: str = DEFAULT_STORE_MODE
    inflight_bytes: int = DEFAULT_STORE_INFLIGHT_BYTES

    def check(self) -> None:
        _check_declared("stores", self)
        lo, hi = BY_NAME["stores.inflight_bytes"].bounds
        if isinstance(self.inflight_bytes, bool) or not isinstance(self.inflight_bytes, int) \
                or not lo <= self.inflight_bytes <= hi:
            raise OptionError("stores.inflight_bytes", "must be between 1 byte and 1 PiB")


@dataclass(frozen=True)
class TierOptions:
    """The tier's size and what stands in for it.

    - ``capacity_bytes``: the tier's capacity (all layers): the arena holds that many chunks and
      reuses the slots of what it evicts (by ``eviction``); None: the trace's recorded tier capacity, else every
      chunk the replay touches, capped by ``max_memory_bytes``. ``--tier-capacity``.
    - ``eviction``: what the tier evicts, a ``kvemu.policies`` name (``lru``, ``fifo``, ``s3fifo``):
      the arena's slots and, in closed loop, the replayed engine's offload tier; None: the trace's
      ``engine.tier_eviction`` (`kvemu record --tier-eviction`), else lru. Other than lru only on an
      offload trace whose tier is bounded (given or recorded); not with ``stack`` (each level has
      its ``policy=``). ``--tier-eviction``.
    - ``max_memory_bytes``: the largest arena in memory (default 4 GiB): a tier nobody sized (unbounded,
      or as recorded) that would need more is replayed as one of this size, reusing the slots of
      what it evicts, with a warning; a given ``capacity_bytes`` is never shrunk: an arena larger than
      this is refused. ``--max-memory``.
    - ``emulate_missing``: a backend this machine cannot run (a NUMA node it lacks, no io_uring) is
      replaced by its emulated counterpart, and the results say so. ``--emulate-missing``.
    - ``devices``: devices of the emulated tier's profile that the instances' tier is made of; None:
      one per instance. A shared tier has ``devices`` x the profile's bandwidth for all instances to
      queue on, so a shared tier and its replicated counterpart have the same hardware by default and
      the comparison is about dedup alone; ``devices=1`` is the old shared tier (one device for all).
      A replicated tier is one device per instance. ``--tier-devices``.
    - ``stack``: a stack of tiers (kvemu.replay.stack.StackSpec, from ``parse_tiers``), top level first;
      the replay's backend is its top level's and ``capacity_bytes`` its top level's capacity;
      closed loop only. None: one tier. ``--tiers``.
    """

    capacity_bytes: int | None = None
    eviction: str | None = None
    max_memory_bytes: int = DEFAULT_MAX_MEMORY
    emulate_missing: bool = False
    devices: int | None = None
    stack: object | None = None

    def check(self) -> None:
        if self.stack is not None:
            if not isinstance(self.stack, StackSpec):
                raise OptionError("tier.stack", f"must be a StackSpec (kvemu.replay.stack.parse_tiers), "
                                                f"got {self.stack!r}")
            if self.capacity_bytes is not None and self.capacity_bytes != self.stack.levels[0].capacity_bytes:
                raise OptionError("tier.capacity_bytes", "is the stack's top level capacity with a stack: "
                                                         "give it in {tier.stack} only")
            if self.eviction is not None:
                raise OptionError("tier.eviction", "cannot be given with {tier.stack}: each level evicts by its "
                                                   "own policy=NAME")
        if self.eviction is not None and eviction_name_problem(self.eviction):
            raise OptionError("tier.eviction", eviction_name_problem(self.eviction))
        _check_declared("tier", self)


@dataclass(frozen=True)
class InstanceOptions:
    """How many serving instances (emulated GPUs) replay together, and how they share the tier.

    - ``count``: instances, each with its own scheduler in closed loop and a thread of its own
      (default 1, at most 256). ``--instances``.
    - ``sharing``: ``shared`` (default: one tier holds every block once and all instances touch it)
      or ``replicated`` (each instance has its own tier with a copy of every block it uses).
      ``--sharing``.
    """

    count: int = 1
    sharing: str = "shared"

    def check(self) -> None:
        lo, hi = BY_NAME["instances.count"].bounds
        if isinstance(self.count, bool) or not isinstance(self.count, int) or not lo <= self.count <= hi:
            raise OptionError("instances.count", f"must be from {lo} to {hi} (one thread and one spill file "
                                                 f"each), got {self.count}")
        _check_declared("instances", self)


@dataclass(frozen=True)
class DisaggOptions:
    """Prefill/decode disaggregation in closed loop (docs/replay.md, "Prefill/decode disaggregation").

    Each field left None is the trace's recorded deployment's (its metadata's ``deployment``, from
    `kvemu record --prefill-instances`), else the default named here: a trace recorded with a
    deployment replays as that deployment unless told otherwise.

    - ``prefill_instances``, ``decode_instances``: the deployment's prefill and decode instances,
      each with the trace's GPUs and parallelism; both or neither (None: the trace's deployment,
      else colocated, every instance doing both phases). ``--prefill-instances``,
      ``--decode-instances``.
    - ``transfer``: how the KV reaches the decode instance: ``rdma`` (GPU to GPU over the RDMA NIC
      link, layer by layer as the prefill computes), ``rdma-pull`` (the decode instance reads the
      blocks once the prefill is done, as vLLM's NixlConnector), ``host`` (staged through host DRAM
      on both sides); each also as ``rdma:PROFILE`` (a storage profile: the hand-off pays its transfer
      engine's software parts, as the store does; default mooncake-gdr, which has none), ``pool`` or ``pool:SPEC`` (prefill stores into the replay's tier layer by
      layer as it computes each layer, decode loads from it once the stores are done; SPEC, if
      given, must be the replay's backend), ``pool-serial`` or ``pool-serial:SPEC`` (the same with
      the stores serial inside the prefill's steps, an upper bound). None: the trace's, else rdma. ``--transfer``.
    - ``prefill_routing``, ``decode_routing``: each side's router (as ``--routing``); None: the
      trace's, else round-robin. ``--prefill-routing``, ``--decode-routing``.
    - ``threshold_tokens``: conditional disaggregation: a prompt of fewer tokens is prefilled on
      the decode instance it is routed to, with no hand-off; None: the trace's, else every prompt is
      disaggregated. ``--disagg-threshold``.
    - ``colocated``: replay colocated (``instances.count`` instances doing both phases) even if the
      trace records a deployment; not with the fields above. ``--colocated``.
    - ``decode_chunked_prefill``: ``on`` (default: the trace's engine, prompts prefilled in chunks of
      the step budget) or ``off`` (vLLM's ``enable_chunked_prefill=False`` in the decode instances
      alone: a prompt they prefill, those under the threshold and the tails handed-over prompts
      compute, goes in one step; their budget holds at least the longest prompt they prefill
      whole). ``--decode-chunked-prefill``.
    """

    prefill_instances: int | None = None
    decode_instances: int | None = None
    transfer: str | None = None
    prefill_routing: str | None = None
    decode_routing: str | None = None
    threshold_tokens: int | None = None
    colocated: bool = False
    decode_chunked_prefill: str = "on"

    @property
    def enabled(self) -> bool:
        return self.prefill_instances is not None

    @property
    def path(self) -> str:
        """The transfer path's name (``pool`` for ``pool:SPEC``)."""
        return (self.transfer or DEFAULT_TRANSFER).partition(":")[0]

    @property
    def pool(self) -> bool:
        """The hand-off goes through the pool (``pool``, ``pool-serial``)."""
        return self.path in ("pool", "pool-serial")

    @property
    def handoff_profile(self) -> str | None:
        """The storage profile whose transfer parts a link hand-off pays (``rdma:PROFILE``), or None."""
        head, _, spec = (self.transfer or DEFAULT_TRANSFER).partition(":")
        return spec or None if head not in ("pool", "pool-serial") else None

    @property
    def pool_spec(self) -> str | None:
        head, _, spec = (self.transfer or DEFAULT_TRANSFER).partition(":")
        return spec or None if head in ("pool", "pool-serial") else None

    def given(self) -> dict:
        """The deployment's fields given here (not None)."""
        return {name: getattr(self, name) for name in DEPLOYMENT_FIELDS if getattr(self, name) is not None}

    def check(self) -> None:
        _check_declared("disagg", self)
        if self.colocated and self.given():
            raise OptionError("disagg.colocated", f"cannot be given with {{disagg.{next(iter(self.given()))}}}: "
                                                  f"a colocated replay has no prefill and decode sides")
        check_deployment("disagg", **{name: getattr(self, name) for name in DEPLOYMENT_FIELDS})
        if self.colocated and self.decode_chunked_prefill != "on":
            raise OptionError("disagg.colocated", "cannot be given with {disagg.decode_chunked_prefill}: a colocated "
                                                  "replay has no decode side")

    def resolve(self, deployment: dict | None) -> DisaggOptions:
        """The options the replay runs: each field not given taken from ``deployment`` (the trace's
        recorded one, already validated, or None), else its default; colocated when neither names
        the instances (or ``colocated``). Raises OptionError for a field that needs the instances."""
        if self.colocated:
            return DisaggOptions(colocated=True)
        recorded = {k: v for k, v in (deployment or {}).items() if k in DEPLOYMENT_FIELDS and v is not None}
        mine = {**recorded, **self.given()}
        if mine.get("prefill_instances") is None:
            if mine or self.decode_chunked_prefill != "on":
                name = next(iter(mine)) if mine else "decode_chunked_prefill"
                raise OptionError(f"disagg.{name}", "has no effect without {disagg.prefill_instances} and "
                                                    "{disagg.decode_instances} (the trace records no deployment)")
            return DisaggOptions()
        return DisaggOptions(**{"transfer": DEFAULT_TRANSFER, "prefill_routing": DEFAULT_ROUTING,
                                "decode_routing": DEFAULT_ROUTING, **mine},
                             decode_chunked_prefill=self.decode_chunked_prefill)


@dataclass(frozen=True)
class CostOptions:
    """What the results' ``cost`` section prices the run with (docs/replay.md, "Cost and energy").

    - ``prices``: a price table (TOML, the layout of kvemu/data/prices.toml); None: the one kvemu
      ships. ``--prices``.
    - ``amortise_years``: the period the tier's capacity is amortised over, in years (default 3,
      as ``analyze capacity``). ``--amortise-years``.
    """

    prices: str | None = None
    amortise_years: float = DEFAULT_AMORTISE_YEARS

    def check(self) -> None:
        v = self.amortise_years
        lo, hi = BY_NAME["cost.amortise_years"].bounds
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise OptionError("cost.amortise_years", f"must be a number of years from {lo:g} to {hi:g}, got {v!r}")
        if self.prices is not None and (not isinstance(self.prices, (str, os.PathLike)) or not str(self.prices)):
            raise OptionError("cost.prices", f"must be a path to a price table, got {self.prices!r}")


@dataclass(frozen=True)
class OutputOptions:
    """Where the results go and how they are named.

    - ``label``: the run's label in reports; None: made from the backend, the trace's tier policy
      and the data path options. ``--label``.
    - ``force``: replace an existing output file. ``--force``.
    - ``repeat``: replay this many times from scratch (1 to 100); the results are the repetition with
      the median median-TTFT, and their metadata holds every repetition's figures. ``--repeat``.
    - ``dataset``: instead of an output file, a folder holding a Hive-partitioned results dataset
      (``backend=/host=/run_id=``). ``--dataset``.
    - ``run_id``: the run's id (default: a fresh random one).
    """

    label: str | None = None
    force: bool = False
    repeat: int = 1
    dataset: str | None = None
    run_id: str | None = None

    def check(self) -> None:
        lo, hi = BY_NAME["output.repeat"].bounds
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or not lo <= self.repeat <= hi:
            raise OptionError("output.repeat", f"must be an integer from {lo} to {hi}, got {self.repeat!r}")
        _check_declared("output", self)


@dataclass(frozen=True)
class ReplayOptions(OptionGroups):
    """Everything :func:`kvemu.replay` can be told, in groups (each documented on its class):
    ``schedule`` (:class:`ScheduleOptions`), ``window`` (:class:`WindowOptions`), ``datapath``
    (:class:`DataPathOptions`), ``stores`` (:class:`StoreOptions`), ``tier``
    (:class:`TierOptions`), ``instances`` (:class:`InstanceOptions`), ``cost``
    (:class:`CostOptions`), ``output`` (:class:`OutputOptions`). ``ReplayOptions()`` is the command line's defaults.

    Example::

        ReplayOptions(window=WindowOptions(layers=2, requests=(0, 50)),
                      instances=InstanceOptions(count=2, sharing="replicated"))
    """

    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    window: WindowOptions = field(default_factory=WindowOptions)
    datapath: DataPathOptions = field(default_factory=DataPathOptions)
    stores: StoreOptions = field(default_factory=StoreOptions)
    tier: TierOptions = field(default_factory=TierOptions)
    instances: InstanceOptions = field(default_factory=InstanceOptions)
    disagg: DisaggOptions = field(default_factory=DisaggOptions)
    cost: CostOptions = field(default_factory=CostOptions)
    output: OutputOptions = field(default_factory=OutputOptions)

    def check(self) -> ReplayOptions:
        """Checks every field on its own, then the fields together; the checks that need the trace
        come when it is read."""
        super().check()
        s = self.schedule
        if s.kv_load == "async" and s.schedule == "recorded":
            raise OptionError("schedule.kv_load", "async needs {schedule.schedule} closed: the recorded schedule "
                                                  "loads where it was recorded")
        if self.tier.stack is not None and s.schedule == "recorded":
            raise OptionError("tier.stack", "needs {schedule.schedule} closed: the recorded schedule keeps its "
                                            "steps, so no level can change what is loaded or recomputed")
        if self.tier.stack is not None and s.kv_load != "async" and self.tier.stack.prefetch != "wait_complete":
            raise OptionError("tier.stack", f"prefetch={self.tier.stack.prefetch} decides when a request stops "
                                            f"waiting for its asynchronous loads: it needs {{schedule.kv_load}} async")
        if self.disagg.enabled:
            if s.schedule == "recorded":
                raise OptionError("disagg.prefill_instances", "needs {schedule.schedule} closed: roles are the "
                                                              "replayed engine's (the recorded schedule keeps its steps)")
            if self.instances.count != 1:
                raise OptionError("instances.count", "cannot be given with {disagg.prefill_instances}: the deployment's "
                                                     "instances are {disagg.prefill_instances} plus "
                                                     "{disagg.decode_instances}")
            if self.tier.stack is not None:
                raise OptionError("tier.stack", "is not replayed with {disagg.prefill_instances} yet")
        if s.routing != "round-robin" and s.schedule == "recorded":
            raise OptionError("schedule.routing", "needs {schedule.schedule} closed: the recorded schedule spreads "
                                                  "requests round-robin")
        if s.arrivals == "session":
            if s.schedule == "recorded":
                raise OptionError("schedule.arrivals", "session needs {schedule.schedule} closed: the recorded "
                                                       "schedule keeps its steps")
            if self.instances.count != 1 or self.disagg.enabled:
                raise OptionError("schedule.arrivals", "session is replayed on one instance only yet (the router "
                                                       "routes recorded arrivals)")
        return self


# --------------------------------------------------------------------------------- the option table
def _tiers_help() -> str:
    return ("A stack of tiers below HBM, top first (closed loop; docs/replay.md, \"A stack of tiers\"): "
            "a .toml file of [[tier]] tables, or levels separated by ';', each BACKEND|cap=SIZE[,policy="
            f"{'|'.join(policy_names(online=True))}]"
            "[,link=LINK][,sharing=private|shared][,devices=N], private levels first, e.g. "
            "\"dram|cap=64GiB;vemu:cxl-pool|cap=2TiB,sharing=shared;vemu:nvme|cap=8TiB,sharing=shared\"; a "
            "segment without '|' sets the stack's options: "
            f"'placement={'|'.join(PLACEMENTS)}[,promote=1][,selective_hits=N]' (default {DEFAULT_PLACEMENT}; "
            "as analyze capacity --placement) "
            "and, with --kv-load async, 'prefetch=wait_complete|timeout|best_effort[,prefetch_timeout_ms=MS]"
            "[,prefetch_timeout_per_ki_token_ms=MS]' (SGLang HiCache's prefetch policies; default "
            "wait_complete, 2000 ms + 100 ms per 1024 tokens).")



def _tier_eviction_help() -> str:
    return (f"What the tier evicts: {', '.join(policy_names(online=True))} (kvemu.policies): the arena's "
            f"slots and, closed loop, the replayed engine's offload tier; other than lru on an offload trace "
            f"whose tier is bounded (--tier-capacity or recorded). Default: the trace's (record "
            f"--tier-eviction), else {DEFAULT_TIER_EVICTION}.")


#: Every replay option, in the order ``kvemu replay --help`` lists them (``--backend`` and
#: ``--out``, arguments of :func:`kvemu.replay` rather than options, are the command's own).
OPTIONS: tuple[Opt, ...] = declare(ReplayOptions, (
    Opt("tier.stack", "--tiers", _tiers_help, kind="tiers"),
    Opt("output.dataset", "--dataset", kind="folder",
        help="Instead of --out: add the run to a Hive-partitioned results dataset in this folder "
             "(backend=/host=/run_id=), which kvemu report, DuckDB and pandas read whole."),
    Opt("datapath.overlap", "--overlap", kind="bool", sweep="overlap",
        help="Pipeline KV loads with compute layer by layer."),
    Opt("datapath.link", "--link", kind="choice", choices=tuple(LINKS), sweep="link",
        help="How the GPU reaches the tier: pcie4-x16, pcie5-x16, nvlink-c2c, cxl-x16, rdma-200g, or cpu (no link "
             "limit: the CPU consumes KV); docs/tier-profiles.md."),
    Opt("stores.timing", "--store-timing", kind="choice", choices=("async", "serial"), sweep="store_timing",
        help="async: stores overlap later compute, as vLLM's and LMCache's offloading (stalling past "
             "--store-inflight bytes in flight); serial: on each step's critical path."),
    Opt("stores.inflight_bytes", "--store-inflight", kind="size", bounds=(1, 1 << 50), sweep="store_inflight",
        help="With async stores: bytes in flight before a step stalls."),
    Opt("datapath.chunk_tokens", "--chunk-tokens", kind="int", bounds=(1, 1 << 31), sweep="chunk_tokens",
        help="Transfer unit in tokens (default: the trace's, else 256)."),
    Opt("datapath.layout", "--kv-layout", kind="choice", choices=LAYOUTS, sweep="kv_layout",
        help="Transfer layout (default: the trace's, else per-layer); cross-layer replays every layer."),
    Opt("tier.capacity_bytes", "--tier-capacity", kind="size", bounds=(1, 1 << 62), sweep="tier_capacity",
        help="Capacity of the tier (all layers), e.g. 64GiB: the arena holds that many chunks and reuses "
             "the slots of what it evicts, by --tier-eviction. Closed loop: the replayed engine's tier is bounded too, and a "
             "prefix chunk it evicted is recomputed (a miss, not a load); recorded: the steps stay the "
             "recording's, loads of evicted chunks are counted (tier.load_misses_blocks) and timed as loads. "
             "Default: the trace's recorded tier capacity, else every chunk the replay touches, capped by "
             "--max-memory."),
    Opt("tier.eviction", "--tier-eviction", _tier_eviction_help, choices=policy_names(online=True), metavar="POLICY",
        sweep="tier_eviction"),
    Opt("schedule.schedule", "--schedule", kind="choice", choices=SCHEDULES, sweep="schedule",
        help="closed: the engine model schedules again, each step from the state the tier's KV times "
             "produced (default for traces kvemu's engine recorded, with --instances too); recorded: keep "
             "the trace's steps and stretch the timeline (default for real-run traces); "
             "docs/replay.md."),
    Opt("schedule.kv_load", "--kv-load", kind="choice", choices=KV_LOADS, sweep="kv_load",
        help="Closed loop: load a prefix from the tier inside the request's first prefill step (as "
             "recorded), or asynchronously on a stream of its own while running requests go on (vLLM's "
             "asynchronous KV loading); from a --tiers stack, each level's blocks on that level's own "
             "stream, the stack's prefetch policy deciding how long a request waits for them."),
    Opt("schedule.arrivals", "--arrivals", kind="choice", choices=ARRIVALS, sweep="arrivals",
        help="Closed loop: session releases a request that continues another (a trace with sessions: "
             "parent links, wait_for, sub-agents) when its parent completes plus the recorded gap, so a "
             "slower tier delays every later turn; recorded: every request at its recorded time. Default: "
             "session for a trace with sessions on one instance, recorded otherwise (docs/replay.md)."),
    Opt("schedule.time_scale", "--time-scale", kind="float", sweep="time_scale",
        help="Closed loop: multiply arrival times by this (2 = half the load)."),
    Opt("schedule.request_rate", "--request-rate", kind="float", sweep="request_rate",
        help="Closed loop: rescale arrivals to this mean rate, requests per second (as vllm bench serve "
             "--request-rate)."),
    Opt("window.requests", "--requests", kind="range", sweep="requests", none_word="all",
        help="Replay requests START:END (ids), with their history: closed loop runs every earlier "
             "request first; recorded, co-batched requests are replayed too."),
    Opt("window.arrival_ms", "--arrival-ms", kind="range", sweep="arrival_ms", none_word="all",
        help="Replay requests arriving in START:END ms."),
    Opt("window.layers", "--layers", kind="int", bounds=(1, 1 << 20), sweep="replay_layers", none_word="all",
        help="Replay this many evenly spaced layers; each stands for its share of the model's layers."),
    Opt("window.warmup", "--warmup", kind="float", sweep="warmup",
        help="Share of the requests, in arrival order, that warm the caches and are not counted (closed "
             "loop; as analyze capacity --warmup)."),
    Opt("tier.max_memory_bytes", "--max-memory", kind="size", bounds=(1, 1 << 62),
        help="Largest tier arena: a tier that would need more (unbounded, or a --tier-capacity larger "
             "than this) is replayed as one of this size, reusing the slots of what it evicts."),
    Opt("instances.count", "--instances", kind="int", bounds=(1, MAX_INSTANCES), sweep="instances",
        help="Serving instances (emulated GPUs) replaying together on one tier, one thread each, each with "
             "its own scheduler in closed loop (requests routed by --routing); recorded: round-robin."),
    Opt("instances.sharing", "--sharing", kind="choice", choices=SHARING, sweep="sharing",
        help="With --instances: one tier arena holding each block once, or a copy per instance."),
    Opt("schedule.routing", "--routing", kind="choice", choices=ROUTING, sweep="routing",
        help="With --instances, closed loop: how arriving requests are sent to instances (prefix-aware: "
             "where the request's prefix is held, weighed against the queue there, as Mooncake's conductor)."),
    Opt("disagg.prefill_instances", "--prefill-instances", kind="int", sweep="prefill_instances",
        help="Closed loop, prefill/decode disaggregation: this many prefill instances (each with the trace's "
             "GPUs and parallelism); with --decode-instances. Default: the trace's deployment (record "
             "--prefill-instances), else colocated (docs/replay.md)."),
    Opt("disagg.decode_instances", "--decode-instances", kind="int", sweep="decode_instances",
        help="With --prefill-instances: this many decode instances."),
    Opt("disagg.transfer", "--transfer", kind="str", sweep="transfer",
        help="With --prefill-instances: how a prefilled request's KV reaches its decode instance: rdma (GPU "
             "to GPU over the RDMA NIC, layer by layer), rdma-pull (after the prefill, as vLLM's "
             "NixlConnector), host (staged through host DRAM); each also as rdma:PROFILE, a storage profile "
             "whose transfer engine's software parts the hand-off pays, as the store does (default "
             "mooncake-gdr: none); pool or pool:SPEC (stored into the replay's "
             "tier layer by layer as the prefill computes, loaded from it once stored; SPEC must be the "
             "backend), pool-serial or pool-serial:SPEC (the stores serial inside the prefill's steps). "
             "Default: the trace's deployment's, else rdma."),
    Opt("disagg.prefill_routing", "--prefill-routing", kind="choice", choices=ROUTING, sweep="prefill_routing",
        help="With --prefill-instances: the prefill side's router (default: the trace's deployment's, else "
             "round-robin)."),
    Opt("disagg.decode_routing", "--decode-routing", kind="choice", choices=ROUTING, sweep="decode_routing",
        help="With --prefill-instances: the decode side's router (default: the trace's deployment's, else "
             "round-robin)."),
    Opt("disagg.decode_chunked_prefill", "--decode-chunked-prefill", kind="choice", choices=("on", "off"),
        sweep="decode_chunked_prefill",
        help="With --prefill-instances: off prefills each prompt the decode instances prefill in one step "
             "(vLLM's enable_chunked_prefill=False there alone); on: the trace's engine, chunked."),
    Opt("disagg.threshold_tokens", "--disagg-threshold", kind="int", sweep="disagg_threshold",
        help="With --prefill-instances: conditional disaggregation, a prompt of fewer tokens is prefilled on "
             "its decode instance, with no hand-off (default: the trace's deployment's, else none)."),
    Opt("disagg.colocated", "--colocated", kind="bool", sweep="colocated",
        help="Replay colocated (--instances instances doing both phases) a trace recorded with a deployment "
             "(record --prefill-instances), which is otherwise replayed as that deployment."),
    Opt("output.label", "--label", help="Name of this run in reports (default: backend/policy)."),
    Opt("output.repeat", "--repeat", kind="int", bounds=(1, MAX_REPEAT),
        help="Replay this many times (1-100), each from scratch: the results are the median repetition's, "
             "with every repetition's figures, so that reports show the spread."),
    Opt("tier.devices", "--tier-devices", kind="int", bounds=(1, 4096), sweep="tier_devices",
        help="Devices of the emulated tier's profile the tier is made of (default: one per instance); a "
             "shared tier has that many times its bandwidth. 1: one device for all instances."),
    Opt("tier.emulate_missing", "--emulate-missing", kind="bool",
        help="If the backend cannot run here, replay its emulated counterpart (numa -> emu:remote-numa, "
             "mmap of /dev/dax -> emu:cxl-pool, uring -> emu:nvme); the results say so."),
    Opt("cost.prices", "--prices", kind="file",
        help="Price table (TOML) for the results' cost section (default: the one kvemu ships, "
             "kvemu/data/prices.toml)."),
    Opt("cost.amortise_years", "--amortise-years", kind="float", bounds=AMORTISE_YEARS_BOUNDS, sweep="amortise_years",
        help="Amortisation period of the tier's capacity in the cost section."),
    Opt("output.force", "--force", kind="bool", help="Replace an existing output file."),
    Opt("output.run_id", None),
))
#: The options by field name (``"stores.timing"``).
BY_NAME: dict[str, Opt] = {o.name: o for o in OPTIONS}
#: The flag of each field (errors.OptionError.field), so that a message names what the user typed.
FLAGS: dict[str, str] = flag_map(OPTIONS)
#: The options a sweep's ``[grid]`` can vary, by their key there.
SWEEPABLE: dict[str, Opt] = {o.sweep: o for o in OPTIONS if o.sweep}


def options_from(values: dict) -> ReplayOptions:
    """ReplayOptions from ``{Opt.key(): value}`` (the command line's parsed flags); a field not named
    keeps its default."""
    return ReplayOptions.from_fields(values)


def _check_declared(group: str, obj) -> None:
    """Bound each field of ``obj`` (the group ``group``) by what its Opt declares: its choices, its
    bounds, a bool for a flag; None passes where the field's default is None."""
    for o in OPTIONS:
        if o.group != group or o.name in _OWN_MESSAGE:
            continue
        v = getattr(obj, o.field)
        if v is None and o.default is None:
            continue
        if o.kind == "bool":
            if not isinstance(v, bool):
                raise OptionError(o.name, f"must be true or false, got {v!r}")
        elif o.choices is not None:
            _one_of(o.name, v, o.choices)
        elif o.bounds is not None and o.kind in ("int", "size"):
            _whole(o.name, v, *o.bounds)


#: Fields whose group checks them with a message of its own (from the bounds declared here).
_OWN_MESSAGE = frozenset({"stores.inflight_bytes", "instances.count", "cost.amortise_years", "output.repeat",
                          "tier.stack", "tier.eviction"})


__all__ = ["BY_NAME", "DEFAULT_MAX_MEMORY", "FLAGS", "KV_LOADS", "LAYOUTS", "MAX_INSTANCES", "MAX_REPEAT", "OPTIONS", "Opt",
           "SCHEDULES", "SHARING", "SWEEPABLE", "options_from", "CostOptions", "DataPathOptions", "DisaggOptions", "InstanceOptions", "OutputOptions", "ReplayOptions", "ScheduleOptions",
           "StoreOptions",
           "TierOptions", "WindowOptions"]
