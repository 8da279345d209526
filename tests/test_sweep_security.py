"""Sweeps on Dask, securely (docs/scale-out.md, "Trust model"): the executor's address is checked
without touching the network, plain TCP beyond loopback is refused unless --insecure, and TLS
with throw-away certificates works against a real LocalCluster, while a client without the
cluster's certificates is refused in one line."""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.errors import ConfigError
from kvemu.schema import METADATA_KEY
from kvemu.executors import DaskTarget, is_loopback, parse_executor
from kvemu.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
SPEC = f"""
[sweep]
repetitions = 1   # these tests are about the transport; dram's default three would only add time
[[trace]]
path = "{TRACE}"
[backends]
use = ["vemu:cxl-pool", "dram"]
[grid]
replay_layers = [1]
requests = ["0:4"]
"""


def write_spec(folder: Path) -> Path:
    p = folder / "spec.toml"
    p.write_text(SPEC)
    return p


# ----------------------------------------------------------------------------------- certificates
def _certs_cryptography(folder: Path, prefix: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name(f"{prefix}test-ca")).issuer_name(name(f"{prefix}test-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (folder / f"{prefix}ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role in ("node", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(role)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        (folder / f"{prefix}{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{prefix}{role}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _certs_openssl(folder: Path, prefix: str) -> None:
    def run(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", f"{prefix}ca.key", "-out", f"{prefix}ca.pem", "-subj", f"/CN={prefix}test-ca",
        "-days", "1")
    for role in ("node", "client"):
        run("req", *ec, "-keyout", f"{prefix}{role}.key", "-out", f"{prefix}{role}.csr", "-subj", f"/CN={role}")
        run("x509", "-req", "-in", f"{prefix}{role}.csr", "-CA", f"{prefix}ca.pem", "-CAkey", f"{prefix}ca.key",
            "-CAcreateserial", "-out", f"{prefix}{role}.pem", "-days", "1")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A throw-away CA with a certificate for the cluster (scheduler and worker) and one for the
    client; and a second, unrelated CA with its own pair (``other-``)."""
    folder = tmp_path_factory.mktemp("certs")
    try:
        import cryptography  # noqa: F401

        make = _certs_cryptography
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the 'cryptography' package nor the openssl command is here to make test certificates")
        make = _certs_openssl
    make(folder, "")
    make(folder, "other-")
    return folder


def client_tls(certs: Path, prefix: str = "", ca_prefix: str | None = None) -> dict:
    ca = prefix if ca_prefix is None else ca_prefix
    return {"ca_file": str(certs / f"{ca}ca.pem"), "cert": str(certs / f"{prefix}client.pem"),
            "key": str(certs / f"{prefix}client.key")}


@pytest.fixture(scope="module")
def tls_cluster(certs):
    distributed = pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    from distributed.security import Security

    node = {"tls_ca_file": str(certs / "ca.pem"), "tls_scheduler_cert": str(certs / "node.pem"),
            "tls_scheduler_key": str(certs / "node.key"), "tls_worker_cert": str(certs / "node.pem"),
            "tls_worker_key": str(certs / "node.key"), "tls_client_cert": str(certs / "client.pem"),
            "tls_client_key": str(certs / "client.key")}
    cluster = distributed.LocalCluster(protocol="tls", security=Security(require_encryption=True, **node),
                                       host="127.0.0.1", processes=False, n_workers=1, threads_per_worker=1,
                                       resources={"mem": 1}, dashboard_address=None)
    assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
    yield cluster
    cluster.close()


def meta_of(path) -> dict:
    return json.loads(pq.read_schema(path).metadata[METADATA_KEY])


# ----------------------------------------------------------------------------------- TLS cluster
def test_a_sweep_over_tls_with_certificates_completes(tls_cluster, certs, tmp_path):
    spec, out = write_spec(tmp_path), tmp_path / "out"
    port = tls_cluster.scheduler_address.rsplit(":", 1)[1]
    # dask://HOST:PORT with certificates: TLS
    summary = run_sweep(spec, out, executor=f"dask://127.0.0.1:{port}", tls=client_tls(certs), placement_timeout_s=5)
    assert summary["ran"] == 2 and not summary["failed"]
    files = sorted(out.rglob("results.parquet"))
    assert len(files) == 2 and not (out / ".sweep-work").exists()
    worker = next(iter(tls_cluster.scheduler_info["workers"]))
    for f in files:
        assert meta_of(f)["sweep"]["worker"] == worker and worker.startswith("tls://")


def test_the_cli_runs_a_tls_sweep_with_the_certificate_options(tls_cluster, certs, tmp_path):
    spec, out = write_spec(tmp_path), tmp_path / "out"
    t = client_tls(certs)
    res = CliRunner().invoke(cli, ["sweep", str(spec), "--out", str(out), "--executor", tls_cluster.scheduler_address,
                                   "--tls-ca-file", t["ca_file"], "--tls-cert", t["cert"], "--tls-key", t["key"]])
    assert res.exit_code == 0, res.output
    assert "2 cells run" in res.output
    assert {meta_of(f)["sweep"]["executor"] for f in out.rglob("results.parquet")} == {tls_cluster.scheduler_address}


def test_dask_config_supplies_the_certificates(tls_cluster, certs, tmp_path):
    import dask

    t = client_tls(certs)
    port = tls_cluster.scheduler_address.rsplit(":", 1)[1]
    with dask.config.set({"distributed.comm.tls.ca-file": t["ca_file"], "distributed.comm.tls.client.cert": t["cert"],
                          "distributed.comm.tls.client.key": t["key"]}):
        target = parse_executor(f"dask://localhost:{port}")
        assert target.tls and target.address == f"tls://localhost:{port}"
        summary = run_sweep(write_spec(tmp_path), tmp_path / "out", executor=f"dask://localhost:{port}",
                            placement_timeout_s=5)
    assert summary["ran"] == 2


def _one_line_refusal(args, tmp_path) -> str:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in res.output, res.output
    return lines[0]


def test_without_tls_options_a_tls_scheduler_is_refused_in_one_line(tls_cluster, tmp_path):
    spec, out = write_spec(tmp_path), tmp_path / "nested" / "out"
    port = tls_cluster.scheduler_address.rsplit(":", 1)[1]
    # plain TCP to the TLS port: the scheduler drops the connection
    line = _one_line_refusal(["sweep", str(spec), "--out", str(out), "--executor", f"dask://127.0.0.1:{port}"],
                             tmp_path)
    assert f"cannot connect to the Dask scheduler at tcp://127.0.0.1:{port}" in line and "--tls-ca-file" in line
    # tls:// without certificates: refused before connecting
    t0 = time.monotonic()
    line = _one_line_refusal(["sweep", str(spec), "--out", str(out), "--executor", tls_cluster.scheduler_address],
                             tmp_path)
    assert "TLS needs --tls-ca-file" in line and time.monotonic() - t0 < 2
    assert not (tmp_path / "nested").exists()


@pytest.mark.parametrize("who", ["client certificate of another CA", "scheduler not signed by the CA given"])
def test_mutual_authentication_refuses_the_wrong_certificates(tls_cluster, certs, tmp_path, who):
    # the scheduler checks the client's certificate, and the client the scheduler's
    tls = client_tls(certs, "other-", ca_prefix="") if who.startswith("client") else client_tls(certs, "", "other-")
    with pytest.raises(ConfigError) as e:
        run_sweep(write_spec(tmp_path), tmp_path / "out", executor=tls_cluster.scheduler_address, tls=tls,
                  connect_timeout_s=3)
    assert f"cannot connect to the Dask scheduler at {tls_cluster.scheduler_address}" in str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ address checks
@pytest.mark.parametrize("executor", ["dask://10.255.255.1:8786", "tcp://10.255.255.1:8786",
                                      "dask://sched.example.org:8786", "dask://[fe80::1]:8786",
                                      "dask://127.example.org:8786", "dask://localhost.example.org:8786",
                                      "dask://0.0.0.0:8786"])
def test_plain_tcp_beyond_loopback_is_refused_before_connecting(tmp_path, executor):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    out = tmp_path / "out"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="refusing plain TCP to .* which is not loopback.*--insecure"):
        run_sweep(write_spec(tmp_path), out, executor=executor, connect_timeout_s=30)
    assert time.monotonic() - t0 < 1.0  # no connection was tried (it would take up to 30 s)
    assert not out.exists()


def test_insecure_lets_plain_tcp_through_to_the_connection(tmp_path):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    target = parse_executor("dask://10.255.255.1:8786", insecure=True)
    assert target == DaskTarget(address="tcp://10.255.255.1:8786", host="10.255.255.1")
    # nothing listens there (or it is unreachable): the refusal is now the connection's
    with pytest.raises(ConfigError, match=r"cannot connect to the Dask scheduler at tcp://10\.255\.255\.1:8786"):
        run_sweep(write_spec(tmp_path), tmp_path / "out", executor="dask://10.255.255.1:8786", insecure=True,
                  connect_timeout_s=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("executor,address", [
    ("dask://127.0.0.1:8786", "tcp://127.0.0.1:8786"), ("dask://127.8.9.10:1", "tcp://127.8.9.10:1"),
    ("dask://localhost:8786", "tcp://localhost:8786"), ("dask://[::1]:8786", "tcp://[::1]:8786"),
    ("tcp://localhost:65535", "tcp://localhost:65535"), ("dask://tcp://127.0.0.1:9", "tcp://127.0.0.1:9")])
def test_loopback_plain_tcp_is_allowed(executor, address):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    target = parse_executor(executor)
    assert target.address == address and target.security is None and not target.tls


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.255.255.254", "::1", "localhost", "LOCALHOST", "localhost."]))
    assert not any(map(is_loopback, ["10.0.0.1", "0.0.0.0", "::", "128.0.0.1", "sched.lab", "localhost.lab", "::2"]))


@pytest.mark.parametrize("executor,message", [
    ("dask://sched.lab", "no port; give the scheduler's as HOST:PORT"),
    ("dask://127.0.0.1", "no port"),
    ("dask://", "no port"),
    ("dask://:8786", "no host before the port"),
    ("dask://sched lab:8786", "'sched lab' is not a host name or an IP address"),
    ("dask://a/b:8786", "'a/b' is not a host name"),
    ("dask://h:0", "the port must be a number from 1 to 65535, got '0'"),
    ("dask://h:65536", "from 1 to 65535"),
    ("dask://h:80x", "got '80x'"),
    ("dask://h:8786/path", "got '8786/path'"),
    ("dask://::1:8786", "write an IPv6 address in brackets"),
    ("dask://[::1]8786", "an IPv6 address is written [ADDRESS]:PORT"),
    ("dask://[zz::1]:8786", "'zz::1' is not an IPv6 address"),
    ("dask://ucx://h:1", "unknown executor 'dask://ucx://h:1'"),
    ("ray://h:1", "unknown executor"),
    ("127.0.0.1:8786", "unknown executor"),
])
def test_bad_addresses_are_one_line_config_errors(tmp_path, executor, message):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        run_sweep(write_spec(tmp_path), out, executor=executor)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


def test_contradictory_options_are_refused(certs, tmp_path):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    t = client_tls(certs)
    with pytest.raises(ConfigError, match="--tls-ca-file applies to a Dask executor only"):
        parse_executor("local", tls=t)
    with pytest.raises(ConfigError, match="--insecure applies to a Dask executor only"):
        parse_executor("local", insecure=True)
    with pytest.raises(ConfigError, match="is plain TCP but --tls-ca-file was given: use tls://127.0.0.1:1"):
        parse_executor("tcp://127.0.0.1:1", tls=t)
    with pytest.raises(ConfigError, match="--insecure has no effect with TLS"):
        parse_executor("dask://sched.lab:8786", tls=t, insecure=True)
    # TLS to a host that is not loopback needs no --insecure
    target = parse_executor("dask://sched.lab:8786", tls=t)
    assert target.address == "tls://sched.lab:8786" and target.security.require_encryption


def test_tls_files_are_checked_before_connecting(certs, tmp_path):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    t = client_tls(certs)
    with pytest.raises(ConfigError, match=r"TLS needs --tls-cert \(this client's certificate"):
        parse_executor("tls://sched.lab:8786", tls={"ca_file": t["ca_file"]})
    with pytest.raises(ConfigError, match="--tls-cert .*missing.pem: no such file"):
        parse_executor("tls://sched.lab:8786", tls={**t, "cert": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="--tls-ca-file .*: is a folder, not a PEM file"):
        parse_executor("tls://sched.lab:8786", tls={**t, "ca_file": str(tmp_path)})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="the TLS files .* do not load"):
        parse_executor("tls://sched.lab:8786", tls={**t, "ca_file": str(junk)})
    with pytest.raises(ConfigError, match="do not load: .*the key must match the certificate"):
        parse_executor("tls://sched.lab:8786", tls={**t, "key": str(certs / "other-client.key")})
    # the key may be in the certificate file
    both = tmp_path / "client-and-key.pem"
    both.write_bytes(Path(t["cert"]).read_bytes() + Path(t["key"]).read_bytes())
    assert parse_executor("tls://sched.lab:8786", tls={"ca_file": t["ca_file"], "cert": str(both)}).tls



def test_options_win_over_dask_config_and_a_config_key_never_pairs_with_an_option_cert(certs, tmp_path):
    dask = pytest.importorskip("dask", reason="Dask not installed (pip install 'kvemu[dask]')")
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    t, other = client_tls(certs), client_tls(certs, "other-")
    both = tmp_path / "client-and-key.pem"
    both.write_bytes(Path(t["cert"]).read_bytes() + Path(t["key"]).read_bytes())
    with dask.config.set({"distributed.comm.tls.ca-file": other["ca_file"],
                          "distributed.comm.tls.client.cert": other["cert"],
                          "distributed.comm.tls.client.key": other["key"]}):
        target = parse_executor("tls://sched.lab:8786", tls={"cert": str(both)})
        # the certificate (with its key) from the option, the CA from the config; other's key not used
        assert target.security.tls_client_cert == str(both) and target.security.tls_client_key is None
        assert target.security.tls_ca_file == other["ca_file"]
        with pytest.raises(ConfigError, match="do not load"):  # other's key does not match this certificate
            parse_executor("tls://sched.lab:8786", tls={"cert": t["cert"], "key": other["key"]})
