#!/usr/bin/env python3
"""Capture vLLM's KV cache events into a file that `kvemu record --from-vllm-events` reads.

    python tools/capture_vllm_events.py --endpoint tcp://localhost:5557 --topic kv-events \\
        --out events.msgpack [--duration 600] [--max-batches N] [--force]

Start vLLM with its ZMQ event publisher and prefix caching on, for example:

    vllm serve MODEL --enable-prefix-caching --kv-events-config \\
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'

and start this tool before sending traffic: a ZMQ subscriber only sees messages published after
it connected. Each message is (topic, 8-byte big-endian sequence number, msgpack EventBatch);
the payloads are appended to the file as received, so the file is a msgpack stream of EventBatches
(docs/sources.md). Gaps in the sequence numbers (messages the subscriber missed) are counted and
reported on stderr. Stops after --duration seconds, --max-batches batches, or Ctrl-C.

Needs pyzmq (`pip install pyzmq`); it is not a dependency of kvemu.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def capture(endpoint: str, out, *, topic: str = "", duration_s: float | None = None, max_batches: int | None = None,
            force: bool = False, log=None) -> dict:
    """Subscribe to ``endpoint`` and append each EventBatch payload to ``out``. Returns counts."""
    try:
        import zmq
    except ImportError:
        raise SystemExit("capture_vllm_events needs pyzmq: pip install pyzmq") from None
    out = Path(out)
    stats = {"batches": 0, "bytes": 0, "missed": 0, "first_seq": None, "last_seq": None, "odd_messages": 0}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sock.connect(endpoint)
        deadline = None if duration_s is None else time.monotonic() + duration_s
        with open(out, "wb" if force else "xb") as f:
            while max_batches is None or stats["batches"] < max_batches:
                wait_ms = 200 if deadline is None else int(min(200, max(0.0, deadline - time.monotonic()) * 1e3))
                if deadline is not None and wait_ms <= 0:
                    break
                if not sock.poll(wait_ms):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:  # not (topic, seq, payload): not from vLLM's publisher
                    stats["odd_messages"] += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if stats["last_seq"] is not None and seq > stats["last_seq"] + 1:
                    stats["missed"] += seq - stats["last_seq"] - 1
                    if log:
                        log(f"missed {seq - stats['last_seq'] - 1} batches before sequence number {seq}")
                if stats["first_seq"] is None:
                    stats["first_seq"] = seq
                stats["last_seq"] = seq
                f.write(frames[2])
                f.flush()
                stats["batches"] += 1
                stats["bytes"] += len(frames[2])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(linger=0)
        ctx.term()
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="tcp://localhost:5557", help="vLLM's publisher (default %(default)s)")
    ap.add_argument("--topic", default="", help="topic to subscribe to (vLLM's kv-events-config 'topic')")
    ap.add_argument("--out", required=True, help="capture file to write (msgpack stream of EventBatches)")
    ap.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--max-batches", type=int, default=None, help="stop after this many event batches")
    ap.add_argument("--force", action="store_true", help="replace an existing capture file")
    a = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr)

    try:
        s = capture(a.endpoint, a.out, topic=a.topic, duration_s=a.duration, max_batches=a.max_batches,
                    force=a.force, log=log)
    except FileExistsError:
        log(f"{a.out}: already exists (use --force to replace it)")
        return 2
    log(f"wrote {a.out}: {s['batches']} event batches, {s['bytes']} bytes, sequence numbers {s['first_seq']}.."
        f"{s['last_seq']}, {s['missed']} missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
