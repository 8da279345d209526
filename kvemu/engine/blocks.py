"""KV block tables: which block id holds each ``tokens_per_block`` slice of a request's KV.

Ids of shared prefixes are shared. A workload's chained hash id stands for one hash block of
``hash_block_tokens`` tokens together with everything before it, so the engine block at position
``p`` of a request is identified by (hash id of its hash block, ``p`` within that hash block).
Hash ids are numbered densely in order of first appearance, and engine block id
``dense_hash * S + j`` (``S = hash_block_tokens / tokens_per_block``) keeps consecutive blocks
consecutive, which keeps block tables a handful of runs. An engine block longer than the hash block
(a multiple of it: 32-token engine blocks over Bailian's 16-token hashes) is named by the hash of
its last hash block, which stands for everything before it too.

Only *full* input blocks are shareable (as in vLLM's prefix cache). The partial last input block
and the blocks decode fills hold content of this request alone; they get private ids, allocated
consecutively per request after all shared ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


@dataclass
class BlockTables:
    tokens_per_block: int
    offsets: np.ndarray  # int64 (n + 1): request i's table is ids[offsets[i]:offsets[i+1]]
    ids: np.ndarray  # int64 block ids
    n_full_input: np.ndarray  # int64: leading shareable (full input) blocks per request
    shared_id_space: int  # ids below this are shareable prefix blocks
    id_space: int  # all ids are below this

    def table(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(run offsets per request, run starts, run counts): maximal runs of consecutive ids."""
        ids = self.ids
        n = len(ids)
        brk = np.ones(n, bool)
        if n:
            brk[1:] = ids[1:] != ids[:-1] + 1
            brk[self.offsets[:-1][self.offsets[:-1] < n]] = True
        run_begin = np.flatnonzero(brk)
        run_end = np.append(run_begin[1:], n)
        # which request each run belongs to, and so each request's run offsets
        req_of_run = np.searchsorted(self.offsets, run_begin, side="right") - 1
        run_off = np.zeros(len(self.offsets), np.int64)
        np.add.at(run_off, req_of_run + 1, 1)
        return np.cumsum(run_off), ids[run_begin], (run_end - run_begin)


def _coarse_hashes(offsets: np.ndarray, ids: np.ndarray, n_full: np.ndarray, per: int):
    """Hashes of engine blocks ``per`` hash blocks long: for each request's full engine block k, the
    hash of its hash block ``(k + 1) * per - 1`` (CSR over the full engine blocks only)."""
    out_off = np.zeros(len(n_full) + 1, np.int64)
    np.cumsum(n_full, out=out_off[1:])
    req = np.repeat(np.arange(len(n_full)), n_full)
    k = np.arange(int(out_off[-1])) - out_off[req]
    return out_off, ids[offsets[req] + (k + 1) * per - 1]


def build_block_tables(input_tokens, output_tokens, hash_offsets, hash_ids, hash_block_tokens,
                       tokens_per_block: int) -> BlockTables:
    inp = np.asarray(input_tokens, np.int64)
    out = np.asarray(output_tokens, np.int64)
    n = len(inp)
    tpb = tokens_per_block
    if tpb <= 0:
        raise ConfigError("--block-tokens must be positive")
    # KV is stored for every token but the last generated one (it is never fed back).
    total_blocks = -(-(inp + out - 1) // tpb)
    n_full = inp // tpb
    has_hash = hash_block_tokens is not None and len(hash_ids) > 0
    if has_hash:
        coarse = tpb > hash_block_tokens and tpb % hash_block_tokens == 0
        if hash_block_tokens % tpb and not coarse:
            raise ConfigError(
                f"the workload's hash blocks ({hash_block_tokens} tokens) are not a multiple of "
                f"--block-tokens {tpb}, nor is --block-tokens a multiple of them; choose a block size "
                f"that divides {hash_block_tokens} or that {hash_block_tokens} divides"
            )
        if coarse:
            # an engine block of several hash blocks is named by its last one: chained hashes name
            # everything up to their end
            hash_offsets, hash_ids = _coarse_hashes(np.asarray(hash_offsets, np.int64), np.asarray(hash_ids, np.int64),
                                                    n_full, tpb // hash_block_tokens)
            hash_block_tokens = tpb
        per_hash = hash_block_tokens // tpb
        uniq_first = np.unique(hash_ids, return_index=True, return_inverse=True)
        _, first_idx, inverse = uniq_first
        rank = np.empty(len(first_idx), np.int64)
        rank[np.argsort(first_idx, kind="stable")] = np.arange(len(first_idx))
        dense = rank[inverse.reshape(-1)]
        shared_space = len(first_idx) * per_hash
        # position p of request r lives in hash block p // per_hash of that request
        total_full = int(n_full.sum())
        req = np.repeat(np.arange(n), n_full)
        begin = np.cumsum(n_full) - n_full
        pos = np.arange(total_full, dtype=np.int64) - begin[req]
        hash_pos = np.asarray(hash_offsets, np.int64)[req] + pos // per_hash
        shared = dense[hash_pos] * per_hash + pos % per_hash
    else:
        n_full = np.zeros(n, np.int64) if not has_hash else n_full
        shared_space = 0
        shared = np.zeros(0, np.int64)
        req = np.zeros(0, np.int64)
    n_private = total_blocks - n_full
    priv_begin = shared_space + np.cumsum(n_private) - n_private
    priv_req = np.repeat(np.arange(n), n_private)
    priv_pos = np.arange(int(n_private.sum()), dtype=np.int64) - (np.cumsum(n_private) - n_private)[priv_req]
    private = priv_begin[priv_req] + priv_pos

    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(total_blocks, out=offsets[1:])
    ids = np.empty(int(offsets[-1]), np.int64)
    # shared blocks first in each table, private after them
    shared_dst = offsets[:-1][req] + (np.arange(len(shared)) - (np.cumsum(n_full) - n_full)[req]) if len(shared) else []
    ids[shared_dst] = shared
    ids[offsets[:-1][priv_req] + n_full[priv_req] + priv_pos] = private
    return BlockTables(tpb, offsets, ids, n_full, int(shared_space), int(shared_space + n_private.sum()))
