"""A stack of tiers below HBM as a replay is told it (``--tiers``; docs/replay.md, "A stack of
tiers"): its levels (:class:`LevelSpec`), the stack (:class:`StackSpec`) and :func:`parse_tiers`.

Outside the replay package, beside the option tables (kvemu/replay_options.py), which check a
``tier.stack`` without importing the replay; kvemu/replay/stack.py runs the stack it describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .backend_spec import BackendSpec, parse_spec
from .errors import ConfigError
from .inputs import read_toml
from .links import LINKS
from .policies import get_policy, policy_names
from .stackrules import DEFAULT_PLACEMENT, SELECTIVE, check_placement, check_selective_hits
from .units import human_bytes, parse_size

#: Eviction policies a replayed level can run (kvemu.policies' online ones; ``optimal`` needs the
#: future: analysis only).
STACK_POLICIES = policy_names(online=True)
SHARINGS = ("private", "shared")
#: What a request whose prefix is partly below the top level waits for, with ``--kv-load async``
#: (SGLang HiCache's ``--hicache-storage-prefetch-policy``; docs/replay.md, "Prefetch").
PREFETCH_POLICIES = ("wait_complete", "timeout", "best_effort")
_LEVEL_KEYS = ("backend", "capacity", "link", "policy", "sharing", "devices")
_STACK_KEYS = ("placement", "promote", "selective_hits", "prefetch", "prefetch_timeout_ms",
               "prefetch_timeout_per_ki_token_ms")


@dataclass(frozen=True)
class LevelSpec:
    """One level below HBM: ``backend`` a backend spec text (``dram``, ``vemu:cxl-pool``, ...),
    ``capacity_bytes`` (all layers), ``link`` a kvemu.links name (None: the replay's ``--link``),
    ``policy`` (a kvemu.policies name that needs no future: lru, fifo, s3fifo), ``sharing``
    (private, shared); ``devices`` (a shared emulated or virtual level below the top): the devices
    of its profile that the instances queue on (None: one per instance, as ``--tier-devices``)."""

    backend: str
    capacity_bytes: int
    link: str | None = None
    policy: str = "lru"
    sharing: str = "private"
    devices: int | None = None

    def describe(self) -> dict:
        return {"backend": self.backend, "capacity_bytes": self.capacity_bytes, "link": self.link,
                "policy": self.policy, "sharing": self.sharing, "devices": self.devices}


@dataclass(frozen=True)
class StackSpec:
    """Levels top to bottom, the stack's placement rule (module docstring) and, for ``--kv-load
    async``, its prefetch policy: ``prefetch`` (wait_complete, timeout, best_effort) and the timeout
    of a request's prefetch from the levels below the top, ``prefetch_timeout_ms`` plus
    ``prefetch_timeout_per_ki_token_ms`` per 1024 tokens it prefetches (docs/replay.md, "Prefetch")."""

    levels: tuple[LevelSpec, ...]
    placement: str = DEFAULT_PLACEMENT
    promote: bool = False
    selective_hits: int = 1
    prefetch: str = "wait_complete"
    prefetch_timeout_ms: float = 2000.0
    prefetch_timeout_per_ki_token_ms: float = 100.0
    source: str | None = None  # the .toml file it was read from (None: the compact form)

    def prefetch_timeout_ns(self, tokens: int) -> int:
        """How long a request's prefetch of ``tokens`` tokens from the levels below the top may take
        under ``prefetch=timeout``."""
        return int(round((self.prefetch_timeout_ms + self.prefetch_timeout_per_ki_token_ms * tokens / 1024) * 1e6))

    @property
    def mixed(self) -> bool:
        return len({lv.sharing for lv in self.levels}) > 1

    def files_read(self) -> list[str]:
        """The files a replay on this stack reads: its .toml file and each level's (a profile, a tier
        file): inputs no output may replace."""
        own = [self.source] if self.source else []
        return own + [f for lv in self.levels for f in BackendSpec.parse(lv.backend).files_read()]

    def files_written(self, instances: int = 256) -> list[tuple[str, str]]:
        """(level name, file) of each file a level below the top may write (a tier file, PATH.i per
        instance): none may be an input or an output of the command."""
        return [(f"--tiers level {k + 1} ({lv.backend})", f) for k, lv in enumerate(self.levels)
                for f in BackendSpec.parse(lv.backend).files_written(instances)]

    def label(self) -> str:
        return " + ".join(f"{lv.backend} {human_bytes(lv.capacity_bytes)}" for lv in self.levels)

    def describe(self) -> dict:
        return {"placement": self.placement, "promote": self.promote, "selective_hits": self.selective_hits,
                "prefetch": self.prefetch, "prefetch_timeout_ms": self.prefetch_timeout_ms,
                "prefetch_timeout_per_ki_token_ms": self.prefetch_timeout_per_ki_token_ms,
                "levels": [lv.describe() for lv in self.levels], "label": self.label()}

    def shared_media(self) -> list[tuple[int, int]]:
        """Pairs of levels (indices) whose backends run on the same medium of this host: both measured
        in this host's memory (dram, numa) — their bytes are timed on the same DRAM."""
        mem = [i for i, lv in enumerate(self.levels)
               if parse_spec(lv.backend).kind.mode == "measured" and parse_spec(lv.backend).kind.medium == "memory"]
        return [(a, b) for k, a in enumerate(mem) for b in mem[k + 1:]]


def _shown(v) -> str:
    """A value as a message shows it: repr, at most 60 characters."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _whole(v) -> int | None:
    """``v`` as a whole number (an int, a whole finite float, or the text of an int), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if v == v and abs(v) < 2**53 and v.is_integer() else None
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _level(d: dict, where: str) -> LevelSpec:
    unknown = set(d) - set(_LEVEL_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (keys: {', '.join(_LEVEL_KEYS)})")
    if "backend" not in d or "capacity" not in d:
        raise ConfigError(f"{where}: a level needs a backend and a capacity (e.g. dram|cap=64GiB)")
    for key in ("backend", "link", "policy", "sharing"):  # TOML gives any type: each is a name
        if key in d and not isinstance(d[key], str):
            raise ConfigError(f"{where}: {key} must be a string, got {_shown(d[key])}")
    if isinstance(d["capacity"], bool) or not isinstance(d["capacity"], (str, int)):
        raise ConfigError(f"{where}: capacity must be a size like \"64GiB\" or a number of bytes, got "
                          f"{_shown(d['capacity'])}")
    backend = str(d["backend"]).strip()
    parse_spec(backend)  # the name is checked here, its options by the backend when it opens
    cap = parse_size(str(d["capacity"]), f"{where}: capacity")
    if cap <= 0:
        raise ConfigError(f"{where}: capacity must be above 0, got {d['capacity']!r}")
    policy = str(d.get("policy", "lru"))
    get_policy(policy, where, online=True)
    link = d.get("link")
    if link is not None and link not in LINKS:
        raise ConfigError(f"{where}: unknown link {link!r} (known: {', '.join(LINKS)})")
    sharing = str(d.get("sharing", "private"))
    if sharing not in SHARINGS:
        raise ConfigError(f"{where}: sharing must be private or shared, got {sharing!r}")
    devices = d.get("devices")
    if devices is not None:
        devices = _whole(devices)
        if devices is None or not 1 <= devices <= 4096:
            raise ConfigError(f"{where}: devices is a whole number from 1 to 4096, got {d['devices']!r}")
        if sharing != "shared":
            raise ConfigError(f"{where}: devices is for a shared level (the devices its instances queue on); "
                              f"a private level is one device per instance")
    return LevelSpec(backend, cap, link, policy, sharing, devices)


def _stack(levels: list, opts: dict, where: str) -> StackSpec:
    if not levels:
        raise ConfigError(f"{where}: the stack has no level")
    if len(levels) > 8:
        raise ConfigError(f"{where}: at most 8 levels, got {len(levels)}")
    placement = check_placement(str(opts.get("placement", DEFAULT_PLACEMENT)), where)
    promote = opts.get("promote", False)
    if isinstance(promote, str):
        if promote not in ("0", "1", "true", "false"):
            raise ConfigError(f"{where}: promote is true or false, got {promote!r}")
        promote = promote in ("1", "true")
    if not isinstance(promote, bool):
        raise ConfigError(f"{where}: promote is true or false, got {promote!r}")
    hits = check_selective_hits(opts.get("selective_hits", 1), where)
    seen_shared = None
    for k, lv in enumerate(levels):
        if lv.sharing == "shared":
            seen_shared = k
        elif seen_shared is not None:
            raise ConfigError(f"{where}: level {k + 1} is private below shared level {seen_shared + 1}; "
                              f"private levels come first (an instance walks its own levels, then the shared ones)")
    prefetch = str(opts.get("prefetch", "wait_complete"))
    if prefetch not in PREFETCH_POLICIES:
        raise ConfigError(f"{where}: unknown prefetch policy {prefetch!r} (known: {', '.join(PREFETCH_POLICIES)})")
    times = []
    for key, default in (("prefetch_timeout_ms", 2000.0), ("prefetch_timeout_per_ki_token_ms", 100.0)):
        raw = opts.get(key, default)
        try:
            v = -1.0 if isinstance(raw, bool) else float(raw)
        except (TypeError, ValueError):
            v = -1.0
        if not 0 <= v <= 3.6e6:
            raise ConfigError(f"{where}: {key} is milliseconds from 0 to 3600000, got {opts.get(key)!r}")
        times.append(v)
    # options the stack's placement or prefetch policy does not use are refused, not ignored
    if "selective_hits" in opts and placement not in SELECTIVE:
        raise ConfigError(f"{where}: selective_hits is for placement write-through-selective (the hits before a "
                          f"block is copied below); this stack's placement is {placement}")
    for key in ("prefetch_timeout_ms", "prefetch_timeout_per_ki_token_ms"):
        if key in opts and prefetch != "timeout":
            raise ConfigError(f"{where}: {key} is for prefetch=timeout; this stack's prefetch is {prefetch}")
    return StackSpec(tuple(levels), placement, promote, hits, prefetch, *times)


def parse_tiers(text: str) -> StackSpec:
    """``--tiers``: a TOML file (``.toml``: optional ``placement``, ``promote``, ``selective_hits``
    and one ``[[tier]]`` table per level, top to bottom, keys ``backend``, ``capacity``, ``link``,
    ``policy``, ``sharing``), or the compact form: levels separated by ``;``, each ``BACKEND|KEY=VALUE,...``
    (the backend spec before ``|`` keeps its own commas: ``uring:/x.bin,qd=8|cap=8TiB``), keys
    ``cap`` (or ``capacity``), ``link``, ``policy``, ``sharing``; a segment without ``|`` whose
    first item has ``=`` sets the stack's options (``placement=write-through,promote=1``)."""
    text = str(text).strip()
    if text.endswith(".toml"):
        p = Path(text)
        _, data = read_toml(p, "--tiers file")
        where = f"--tiers file {p}"
        unknown = set(data) - {"tier", *_STACK_KEYS}
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (keys: tier, {', '.join(_STACK_KEYS)})")
        tiers = data.get("tier")
        if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
            raise ConfigError(f"{where}: expected [[tier]] tables, one per level, top to bottom")
        levels = [_level(t, f"{where}, tier {i + 1}") for i, t in enumerate(tiers)]
        return replace(_stack(levels, data, where), source=text)
    levels, opts = [], {}
    for i, seg in enumerate(s.strip() for s in text.split(";")):
        if not seg:
            continue
        backend, bar, rest = seg.partition("|")
        if not bar and "=" in seg.split(",")[0] and ":" not in seg.split(",")[0]:
            for kv in seg.split(","):
                k, eq, v = kv.strip().partition("=")
                if not eq or k not in _STACK_KEYS:
                    raise ConfigError(f"--tiers: {kv.strip()!r} is not a stack option ({', '.join(_STACK_KEYS)})")
                if k in opts:
                    raise ConfigError(f"--tiers: stack option {k} is given twice; give it once")
                opts[k] = v
            continue
        if not bar:
            raise ConfigError(f"--tiers: level {seg!r} has no capacity; write BACKEND|cap=SIZE (e.g. dram|cap=64GiB)")
        d: dict = {"backend": backend}
        for kv in rest.split(","):
            k, eq, v = kv.strip().partition("=")
            if not eq:
                raise ConfigError(f"--tiers: {kv.strip()!r} in level {backend!r} is not KEY=VALUE")
            key = "capacity" if k == "cap" else k
            if key in d:
                raise ConfigError(f"--tiers: level {backend!r} gives {k} twice (cap and capacity are one key); "
                                  f"give it once")
            d[key] = v
        levels.append(_level(d, f"--tiers level {len(levels) + 1} ({backend})"))
    return _stack(levels, opts, "--tiers")
