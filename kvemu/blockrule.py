"""The block rule: how a trace's prompts are cut into hashed blocks, and the hit ratio it implies.

A source trace names each prompt block by a hash id, and sources disagree on what that means:
the block size (Mooncake 512 tokens, SemiAnalysis x WEKA 64, Bailian and tair-kvcache 16), whether
a hash is scoped to one trace or session or shared by all (``scope``), whether a last, partial
block has a hash that may match another request's (``partial``), the unit of the timestamps, and
whether long prompts are capped. One `BlockRule` says all of it; every reader has its format's
conventions as defaults (docs/workloads.md), options override them, and every trace records the
rule it was made with (metadata ``workload.block_rule``, docs/trace-format.md).

`prefix_hit_ratio` is the theoretical hit ratio under a rule: for each request in arrival order,
the longest prefix of its block hashes that all appeared in earlier requests (of the same scope:
scoping is applied by the reader, which gives ids of different scopes different values), counted
in tokens up to the request's input length. This module is a leaf: it imports nothing of kvemu.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Version of the ``workload.block_rule`` metadata object.
BLOCK_RULE_VERSION = 1
SCOPES = ("global", "local")
TIME_UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1000.0}  # ms per unit
TRUNCATIONS = ("drop", "head")
#: The options a workload spec may give (``KIND:PATH:key=value,...``), in their order.
OPTIONS = ("block_tokens", "scope", "partial", "time_unit", "context_cap", "truncate")


@dataclass(frozen=True)
class BlockRule:
    """How a source's prompts map to hashed blocks (module docstring).

    Attributes:
        block_tokens: tokens per hash block; None for a source without prefix information (Azure).
        scope: "global" (equal ids mean equal blocks across the whole file) or "local" (ids are
            scoped to the format's unit: a SemiAnalysis trace with its sub-agents, a Bailian session,
            a Dynamo session, a tair instance; the reader renumbers them apart).
        partial: whether the hash of a last, partial prompt block may match another request's
            (Mooncake lists ``ceil(input / block)`` hashes and counts it); False makes that block
            the request's own.
        time_unit: unit of the source's timestamps: "ns", "us", "ms" or "s".
        context_cap: longest prompt kept, in tokens; None for no cap.
        truncate: what happens to a prompt over ``context_cap``: "drop" the request, or keep its
            "head" (its first ``context_cap`` tokens; a block cut in two becomes the request's own).
    """

    block_tokens: int | None
    scope: str = "global"
    partial: bool = True
    time_unit: str = "ms"
    context_cap: int | None = None
    truncate: str = "drop"

    def problem(self) -> str | None:
        """What is wrong with this rule, or None."""
        if self.block_tokens is not None and (type(self.block_tokens) is not int or self.block_tokens < 1):
            return f"block_tokens must be a positive integer, got {self.block_tokens!r}"
        if self.scope not in SCOPES:
            return f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}"
        if type(self.partial) is not bool:
            return f"partial must be true or false, got {self.partial!r}"
        if self.time_unit not in TIME_UNITS:
            return f"time_unit must be one of {', '.join(TIME_UNITS)}, got {self.time_unit!r}"
        if self.context_cap is not None and (type(self.context_cap) is not int or self.context_cap < 1):
            return f"context_cap must be a positive integer, got {self.context_cap!r}"
        if self.truncate not in TRUNCATIONS:
            return f"truncate must be one of {', '.join(TRUNCATIONS)}, got {self.truncate!r}"
        return None

    def to_dict(self) -> dict:
        """The metadata object (``workload.block_rule``)."""
        return {"version": BLOCK_RULE_VERSION, "block_tokens": self.block_tokens, "scope": self.scope,
                "partial": self.partial, "time_unit": self.time_unit, "context_cap": self.context_cap,
                "truncate": self.truncate}

    def text(self) -> str:
        """One line for `kvemu trace info`."""
        return rule_text(self.to_dict())


def rule_text(rule: dict) -> str:
    """A recorded rule (``workload.block_rule``) in words."""
    if rule.get("block_tokens") is None:
        return f"no prefix information; timestamps in {rule.get('time_unit')}"
    fate = "dropped" if rule.get("truncate") == "drop" else "cut to their head"
    cap = ("no context cap" if rule.get("context_cap") is None else
           f"prompts over {rule['context_cap']:,} tokens {fate}")
    return (f"{rule['block_tokens']}-token blocks, {rule.get('scope')} hash scope, partial last block "
            f"{'counted' if rule.get('partial') else 'not counted'}, timestamps in {rule.get('time_unit')}, {cap}")


def parse_value(key: str, text: str):
    """A spec option's value, typed (ValueError naming what is expected)."""
    if key in ("block_tokens", "context_cap"):
        if key == "context_cap" and text in ("none", ""):
            return None
        if not text.isdigit():
            raise ValueError(f"{key} must be a positive integer, got {text!r}")
        return int(text)
    if key == "partial":
        if text not in ("0", "1", "true", "false"):
            raise ValueError(f"partial must be 0 or 1, got {text!r}")
        return text in ("1", "true")
    return text


def prefix_hit_ratio(input_tokens: np.ndarray, hash_offsets: np.ndarray, hash_ids: np.ndarray,
                     block_tokens: int | None) -> float:
    """Theoretical prefix-hit ratio in input tokens (module docstring): requests in the order given,
    each hitting on the longest run of leading hashes that all appeared in earlier requests, counted
    as ``min(run * block_tokens, input)`` tokens. 0.0 without prefix information."""
    inp = np.asarray(input_tokens, np.int64)
    total = int(inp.sum())
    if block_tokens is None or len(hash_ids) == 0 or total == 0:
        return 0.0
    offsets = np.asarray(hash_offsets, np.int64)
    counts = np.diff(offsets)
    req = np.repeat(np.arange(len(inp)), counts)
    _, first_index, inverse = np.unique(hash_ids, return_index=True, return_inverse=True)
    seen_before = req[first_index][inverse.reshape(-1)] < req
    # the leading run of each request: positions before its first miss
    misses = np.cumsum(~seen_before)
    before = np.where(offsets[:-1] > 0, misses[np.maximum(offsets[:-1] - 1, 0)], 0)
    run = np.bincount(req, weights=((misses - before[req]) == 0), minlength=len(inp)).astype(np.int64)
    return float(np.minimum(run * block_tokens, inp).sum() / total)
