"""What a plan can be told (:class:`PlanOptions`), and its option table (:data:`OPTIONS`, made with
kvemu.option_table as replay's and record's are): ``kvemu plan --help`` is made from it, and each
flag's value becomes the field's by the table alone (:func:`options_from_flags`). The SLO, the
levels and the trace (or the record options that make one) are :func:`kvemu.plan.plan`'s
arguments, the command's own. A leaf module but for kvemu.option_table.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .option_table import Opt, declare

#: Frontier points replayed at most by default, and the requests each replays by default (the first N).
DEFAULT_REPLAY_MAX = 4
DEFAULT_REPLAY_REQUESTS = 1000
#: Layers a replay runs (each stands for its share of the model's; virtual time).
DEFAULT_REPLAY_LAYERS = 2
#: The analysis's placement rule for the grid by default (the fast path: kvemu/plan.py's docstring).
DEFAULT_ANALYSIS_PLACEMENT = "inclusive"
#: The placement rule the replay runs by default (as replay --tiers and analyze capacity --stack).
DEFAULT_PLACEMENT = "write-back"


@dataclass
class PlanOptions:
    """Everything :func:`kvemu.plan.plan` can be told besides the trace, the SLO and the levels; each
    field is the flag of :data:`OPTIONS` named after it (``replay_max``: ``--replay``), ``workers``,
    ``tls`` and ``insecure`` the Python API's alone (the local processes at most; the Dask cluster's
    TLS, as kvemu.executors takes it)."""

    policies: tuple[str, ...] = ("lru",)
    placement: str = DEFAULT_PLACEMENT
    analysis_placement: str = DEFAULT_ANALYSIS_PLACEMENT
    prefetch: tuple[str, ...] = ()
    instances: int = 1
    shared: bool = True
    warmup: float = 0.0
    prices_path: str | None = None
    amortise_years: float = 3.0
    replay_max: int = DEFAULT_REPLAY_MAX
    replay_requests: int = DEFAULT_REPLAY_REQUESTS
    replay_layers: int = DEFAULT_REPLAY_LAYERS
    executor: str = "local"
    workers: int | None = None
    keep_infeasible: bool = False
    compression: bool = False
    tls: dict = field(default_factory=dict)
    insecure: bool = False


@dataclass
class _Root:
    """kvemu.option_table.declare reads groups: the plan's options are one, ``plan``."""

    plan: PlanOptions = field(default_factory=PlanOptions)


def _policies_help() -> str:
    from .policies import policy_names

    return f"Eviction policies to try (online ones: {', '.join(policy_names(online=True))})."


def _prefetch_help() -> str:
    from .stackspec import PREFETCH_POLICIES

    return (f"Prefetch policies to try in the replay ({', '.join(PREFETCH_POLICIES)}; SGLang HiCache's): each "
            f"frontier point is replayed with --kv-load async under each. The analysis models in-step loads and "
            f"no prefetch policy, so it cannot tell them apart: the replay does. Default: none, loads in-step.")


#: Every `kvemu plan` option, in the order ``kvemu plan --help`` lists them after --slo and --level.
OPTIONS: tuple[Opt, ...] = declare(_Root, (
    Opt("plan.policies", "--policies", _policies_help, metavar="LIST"),
    Opt("plan.placement", "--placement", "The placement rule the replay runs (as replay --tiers placement=).",
        metavar="RULE"),
    Opt("plan.analysis_placement", "--analysis-placement",
        "The rule the grid is analysed under: inclusive is the fast path (each level a cache of the whole "
        "stream); the replay's own rule is exact but one Python call per block (docs/analysis.md, \"Planner\").",
        metavar="RULE"),
    Opt("plan.prefetch", "--prefetch", _prefetch_help, metavar="LIST"),
    Opt("plan.instances", "--instances", "Serving instances in the replay.", kind="int"),
    Opt("plan.shared", "--sharing", "With --instances: the levels shared by every instance, or one copy each.",
        kind="choice", choices=("shared", "replicated")),
    Opt("plan.warmup", "--warmup", "Share of the requests, in arrival order, that warm the levels and are not "
        "counted.", kind="float"),
    Opt("plan.prices_path", "--prices", "Price table (TOML; default the one kvemu ships).", kind="file"),
    Opt("plan.amortise_years", "--amortise-years", "Amortisation period of the levels' capacity.", kind="float"),
    Opt("plan.replay_max", "--replay", "Frontier points replayed at most, the cheapest first (0: none).", kind="int"),
    Opt("plan.replay_requests", "--replay-requests", "Each replay runs the trace's first N requests.", kind="int"),
    Opt("plan.replay_layers", "--replay-layers",
        "Layers each replay runs (each stands for its share of the model's; virtual time).", kind="int"),
    Opt("plan.executor", "--executor", "Where the replays run: local processes, or a Dask cluster (as kvemu sweep "
        "--executor).", metavar="local|dask://HOST:PORT"),
    Opt("plan.compression", "--compression",
        "Take each medium's declared inline compression (capacity and price per logical GB), as analyze "
        "capacity --compression.", kind="bool"),
    Opt("plan.keep_infeasible", "--keep-infeasible",
        "Keep candidates the media's physical limits rule out (marked) instead of leaving them out.", kind="bool"),
    Opt("plan.workers", None),
    Opt("plan.insecure", None),
))


def _list(text) -> tuple[str, ...]:
    return tuple(x.strip() for x in str(text).split(",") if x.strip())


#: How a flag's text becomes its field's value, and back (the fields whose flag takes another form).
_FROM_FLAG = {"policies": _list, "prefetch": _list, "shared": lambda v: v == "shared"}
_TO_FLAG = {"policies": ",".join, "prefetch": lambda v: ",".join(v) or None,
            "shared": lambda v: "shared" if v else "replicated"}

#: The table as the command line shows it: each default in its flag's form (``lru``, ``shared``).
CLI_OPTIONS: tuple[Opt, ...] = tuple(replace(o, default=_TO_FLAG[o.field](o.default)) if o.field in _TO_FLAG else o
                                     for o in OPTIONS)
#: The flag of each field.
FLAGS: dict[str, str] = {o.field: o.flag for o in OPTIONS if o.flag}


def options_from_flags(values: dict) -> PlanOptions:
    """PlanOptions from ``{field: the flag's value}`` (the command line's parsed flags, each named
    by its field); a field not named keeps its default."""
    return PlanOptions(**{k: _FROM_FLAG[k](v) if k in _FROM_FLAG else v for k, v in values.items()
                          if not (v is None and k in _FROM_FLAG)})  # a list flag not given: the default


__all__ = ["CLI_OPTIONS", "DEFAULT_ANALYSIS_PLACEMENT", "DEFAULT_PLACEMENT", "DEFAULT_REPLAY_LAYERS",
           "DEFAULT_REPLAY_MAX", "DEFAULT_REPLAY_REQUESTS", "FLAGS", "OPTIONS", "PlanOptions", "options_from_flags"]
