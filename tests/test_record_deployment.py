"""`kvemu record --prefill-instances P --decode-instances D`: the deployment a trace is meant for,
recorded in its metadata (``deployment``) and replayed by default (docs/replay.md,
"Prefill/decode disaggregation"). Both directions: a trace recorded with a deployment replays as
the same trace recorded without one replayed with the flags given (and its recorded steps are
the colocated ones: the same steps); ``--colocated`` replays it as the colocated trace; a replay
flag overrides the recorded field; bad deployments are refused at record time and in a trace's
metadata, with the bounds of replay's flags."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.schema import iter_entries, read_trace, write_trace
from test_validation import parts  # a trace's parts as write_trace takes them

WORKLOAD = "synthetic:chat:sessions=3,turns=2,output_tokens=6,system_tokens=64,user_tokens=40"
BACKEND = "vemu:cxl-pool"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def refused(res, *words):
    assert res.exit_code == 2, (res.exit_code, res.output)
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("Error: "), res.output
    for w in words:
        assert w in line, (w, line)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy")
    base = ("record", "--workload", WORKLOAD, "--model", "llama3-8b", "--hbm-kv-gib", "0.05")
    plain, pd = d / "plain.parquet", d / "pd.parquet"
    assert run(*base, "--out", plain).exit_code == 0
    res = run(*base, "--prefill-instances", 1, "--decode-instances", 2, "--transfer", "pool", "--out", pd)
    assert res.exit_code == 0, res.output
    return plain, pd


def replay(trace, out, *flags):
    res = run("replay", trace, "--backend", BACKEND, "--layers", 2, "--out", out, *flags)
    assert res.exit_code == 0, res.output
    t = pq.read_table(out)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


def test_record_writes_the_deployment_and_keeps_the_colocated_steps(traces):
    plain, pd = traces
    a, b = read_trace(plain), read_trace(pd)
    assert "deployment" not in a.header.meta
    dep = b.header.meta["deployment"]
    assert {k: v for k, v in dep.items() if k != "recorded_steps"} == {
        "prefill_instances": 1, "decode_instances": 2, "transfer": "pool", "prefill_routing": "round-robin",
        "decode_routing": "round-robin", "threshold_tokens": None}
    # the recording is the colocated engine's: the same steps, requests and entries
    for col in ("start_ns", "compute_ns", "cached_tokens", "tier_hit_tokens", "run_start"):
        assert (getattr(a, col) == getattr(b, col)).all(), col
    for x, y in zip(iter_entries(a), iter_entries(b), strict=True):
        assert all((x[k] == y[k]).all() for k in x)
    info = run("trace", "info", pd)
    assert info.exit_code == 0 and "1 prefill + 2 decode instances" in info.output and "over pool" in info.output
    assert "colocated (none recorded" in run("trace", "info", plain).output


def test_replay_runs_the_recorded_deployment_unless_told_otherwise(traces, tmp_path):
    plain, pd = traces
    cols = ("ttft_ms", "tpot_ms", "decode_instance", "prefill_instance", "handoff_bytes", "ttft_handoff_ns")
    # by default: as the same trace replayed with the deployment's flags given
    got, meta = replay(pd, tmp_path / "d.parquet")
    want, _ = replay(plain, tmp_path / "w.parquet", "--prefill-instances", 1, "--decode-instances", 2,
                     "--transfer", "pool")
    assert {c: got[c] for c in cols} == {c: want[c] for c in cols}
    assert "/pd1x2-pool" in meta["label"] and set(got["decode_instance"]) == {0, 1}
    # a replay flag overrides its field, the others stay the trace's
    got, meta = replay(pd, tmp_path / "r.parquet", "--transfer", "rdma")
    want, _ = replay(plain, tmp_path / "wr.parquet", "--prefill-instances", 1, "--decode-instances", 2)
    assert {c: got[c] for c in cols} == {c: want[c] for c in cols} and "/pd1x2-rdma" in meta["label"]
    # --colocated: the colocated replay of the trace recorded without a deployment
    got, meta = replay(pd, tmp_path / "c.parquet", "--colocated", "--instances", 2)
    want, _ = replay(plain, tmp_path / "wc.parquet", "--instances", 2)
    assert got["ttft_ms"] == want["ttft_ms"] and got["tpot_ms"] == want["tpot_ms"]
    assert "decode_instance" not in got and "/pd" not in meta["label"]


def test_deployments_are_refused_with_replays_bounds(traces, tmp_path):
    plain, pd = traces
    out = tmp_path / "x.parquet"
    base = ("record", "--workload", WORKLOAD, "--model", "llama3-8b", "--out", out)
    refused(run(*base, "--prefill-instances", 1), "--prefill-instances give both --prefill-instances and "
                                                  "--decode-instances, or neither")
    refused(run(*base, "--prefill-instances", 129, "--decode-instances", 1),
            "--prefill-instances must be a whole number from 1 to 128, got 129")
    refused(run(*base, "--transfer", "pool"), "--transfer has no effect without --prefill-instances")
    refused(run(*base, "--prefill-instances", 1, "--decode-instances", 1, "--transfer", "nvlink"),
            "--transfer must be one of rdma, rdma:PROFILE, rdma-pull, rdma-pull:PROFILE, host, host:PROFILE, pool, pool:SPEC, pool-serial or pool-serial:SPEC")
    refused(run(*base, "--prefill-instances", 1, "--decode-instances", 1, "--transfer", "pool", "--tier-policy", "none"),
            "--transfer pool needs --tier-policy offload")
    refused(run(*base, "--prefill-instances", 1, "--decode-instances", 1, "--tier-policy", "resident"),
            "--prefill-instances is not replayed on a resident trace yet")
    assert not out.exists()
    # replay: what the recorded deployment cannot be replayed with names the way out
    refused(run("replay", pd, "--backend", BACKEND, "--instances", 2, "--out", out),
            "--instances cannot be given with", "the trace is recorded for 1 prefill + 2 decode instances",
            "--colocated replays it colocated")
    refused(run("replay", pd, "--backend", BACKEND, "--schedule", "recorded", "--out", out), "--colocated")
    refused(run("replay", pd, "--backend", BACKEND, "--colocated", "--transfer", "rdma", "--out", out),
            "--colocated cannot be given with --transfer")
    refused(run("replay", plain, "--backend", BACKEND, "--decode-routing", "least-loaded", "--out", out),
            "--decode-routing has no effect without", "(the trace records no deployment)")
    assert not out.exists()


@pytest.mark.parametrize("field,value,says", [
    ("prefill_instances", 0, "must be a whole number from 1 to 128, got 0"),
    ("decode_instances", "2", "must be a whole number from 1 to 128, got '2'"),
    ("transfer", "pool:", "must be one of rdma, rdma:PROFILE, rdma-pull, rdma-pull:PROFILE, host, host:PROFILE, pool, pool:SPEC, pool-serial or pool-serial:SPEC"),
    ("decode_routing", "random", "must be one of round-robin, least-loaded, prefix-aware"),
    ("threshold_tokens", -5, "must be a whole number from 1 to 2147483647"),
])
def test_a_trace_deployment_out_of_bounds_is_refused(traces, tmp_path, field, value, says):
    meta, requests, steps, entries = parts(traces[1])
    meta = json.loads(json.dumps(meta))
    meta["deployment"][field] = value
    bad = tmp_path / "bad.parquet"
    write_trace(bad, meta, requests, steps, entries, force=True)
    refused(run("trace", "validate", bad), f"trace metadata deployment.{field} {says}")
    refused(run("replay", bad, "--backend", BACKEND, "--out", tmp_path / "r.parquet"), f"deployment.{field}")


def test_the_python_api_records_a_deployment(tmp_path):
    import kvemu

    opts = kvemu.RecordOptions.from_flat(prefill_instances=2, decode_instances=1, disagg_threshold=64)
    assert opts.deployment == kvemu.DeploymentOptions(2, 1, threshold_tokens=64)
    meta = kvemu.record("synthetic:chat:sessions=1,turns=1,output_tokens=2", "llama3-8b", tmp_path / "t.parquet",
                        kvemu.RecordOptions(deployment=opts.deployment,
                                            output=kvemu.RecordOutputOptions(show_progress=False)))
    assert meta["deployment"]["threshold_tokens"] == 64 and meta["deployment"]["transfer"] == "rdma"
    with pytest.raises(kvemu.OptionError, match="deployment.transfer has no effect without"):
        kvemu.RecordOptions(deployment=kvemu.DeploymentOptions(transfer="host")).check()
