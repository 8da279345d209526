"""The figures of a prefill/decode deployment, shared by the three places that take one: replay's
:class:`kvemu.replay_options.DisaggOptions`, record's deployment (`kvemu record
--prefill-instances`, the trace's ``deployment`` metadata) and the trace's validation, so that the
three are bounded alike (docs/replay.md, "Prefill/decode disaggregation")."""

from __future__ import annotations

from .errors import OptionError

#: Serving instances one replay runs (a thread, a backend context and a spill file each); a
#: deployment's prefill and decode sides have at most half of them each.
MAX_INSTANCES = 256
#: How closed-loop replay routes requests to instances (replay.closed Router).
ROUTING = ("round-robin", "least-loaded", "prefix-aware")
#: How a disaggregated deployment hands a prefilled request's KV to its decode instance
#: (replay.closed.disagg; ``pool`` and ``pool-serial`` also as ``pool:SPEC``, SPEC the replay's backend;
#: ``rdma``, ``rdma-pull`` and ``host`` also as ``rdma:PROFILE``, the storage profile whose transfer
#: engine's software parts the hand-off pays, default HANDOFF_PROFILE).
TRANSFERS = ("rdma", "rdma-pull", "host", "pool", "pool-serial")
#: The hand-off path and the routers of a deployment that names none.
DEFAULT_TRANSFER = "rdma"
#: The transfer engine a link hand-off runs on when none is named: Mooncake's with GPUDirect RDMA, whose
#: zero-copy transfers have no software part on the data path (profiles.BUILTIN_PROFILES).
HANDOFF_PROFILE = "mooncake-gdr"
DEFAULT_ROUTING = "round-robin"
#: A deployment's fields, as DisaggOptions and the trace's ``deployment`` name them.
FIELDS = ("prefill_instances", "decode_instances", "transfer", "prefill_routing", "decode_routing",
          "threshold_tokens")


def _whole(field: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise OptionError(field, f"must be a whole number from {lo} to {hi}, got {value!r}")


def check_deployment(group: str, prefill_instances=None, decode_instances=None, transfer=None,
                     prefill_routing=None, decode_routing=None, threshold_tokens=None) -> None:
    """Raise :class:`OptionError` naming ``group.FIELD`` for the first field of a deployment that is
    wrong; None stands for "not given". Both instance counts or neither; the others only with them."""
    if (prefill_instances is None) != (decode_instances is None):
        raise OptionError(f"{group}.prefill_instances", f"give both {{{group}.prefill_instances}} and "
                                                         f"{{{group}.decode_instances}}, or neither")
    for name, v in (("prefill_instances", prefill_instances), ("decode_instances", decode_instances)):
        if v is not None:
            _whole(f"{group}.{name}", v, 1, MAX_INSTANCES // 2)
    if transfer is not None:
        head, colon, spec = transfer.partition(":") if isinstance(transfer, str) else (None, "", "")
        if head not in TRANSFERS or (colon and not spec):
            raise OptionError(f"{group}.transfer", f"must be one of rdma, rdma:PROFILE, rdma-pull, rdma-pull:PROFILE, "
                                                   f"host, host:PROFILE, pool, pool:SPEC, pool-serial or "
                                                   f"pool-serial:SPEC, got {transfer!r}")
    for name, v in (("prefill_routing", prefill_routing), ("decode_routing", decode_routing)):
        if v is not None and v not in ROUTING:
            raise OptionError(f"{group}.{name}", f"must be one of {', '.join(ROUTING)}, got {v!r}")
    if threshold_tokens is not None:
        _whole(f"{group}.threshold_tokens", threshold_tokens, 1, (1 << 31) - 1)
