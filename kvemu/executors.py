"""Where a sweep's cells run: this process (``local``) or a Dask cluster, and how kvemu connects to
one. Plain TCP is accepted only on loopback unless ``--insecure`` is given; elsewhere the client
connects with TLS and mutual certificates (docs/scale-out.md, "Trust model and TLS")."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import ssl
import threading
from dataclasses import dataclass

from .errors import ConfigError
from .inputs import not_regular

DASK_INSTALL_HINT = "pip install 'kvemu[dask]'"


#: Dask's configuration keys that hold a client's TLS files (``dask.config``; a value may also be
#: the PEM text itself), used where the matching option is not given.
TLS_CONFIG_KEYS = {"ca_file": "distributed.comm.tls.ca-file", "cert": "distributed.comm.tls.client.cert",
                   "key": "distributed.comm.tls.client.key"}
TLS_OPTIONS = {"ca_file": "--tls-ca-file", "cert": "--tls-cert", "key": "--tls-key"}
_EXECUTOR_FORMS = "local, dask://HOST:PORT, tls://HOST:PORT or tcp://HOST:PORT"
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")


@dataclass(frozen=True)
class DaskTarget:
    """A scheduler to submit cells to: its address (``tcp://`` or ``tls://``) and, for TLS, the
    ``distributed.security.Security`` the client connects with."""

    address: str
    host: str
    security: object | None = None

    @property
    def tls(self) -> bool:
        return self.address.startswith("tls://")


def is_loopback(host: str) -> bool:
    """``localhost`` or a literal loopback address (127.0.0.0/8, ::1). Other names are not looked
    up: what a name resolves to may change, and a refusal must not wait on DNS."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split_address(executor: str, rest: str) -> tuple[str, int]:
    """HOST and PORT of ``HOST:PORT`` or ``[IPV6]:PORT``; a one-line ConfigError otherwise."""
    where = f"--executor {executor}"
    if rest.startswith("["):
        host, sep, tail = rest[1:].partition("]")
        if not sep or not tail.startswith(":"):
            raise ConfigError(f"{where}: an IPv6 address is written [ADDRESS]:PORT")
        port = tail[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{where}: '{host}' is not an IPv6 address") from None
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            raise ConfigError(f"{where}: no port; give the scheduler's as HOST:PORT (dask scheduler listens on 8786 "
                              "by default)")
        if ":" in host:
            raise ConfigError(f"{where}: write an IPv6 address in brackets, [ADDRESS]:PORT")
        if not host:
            raise ConfigError(f"{where}: no host before the port")
        if not _HOSTNAME.fullmatch(host):
            raise ConfigError(f"{where}: '{host}' is not a host name or an IP address")
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: the port must be a number from 1 to 65535, got '{port}'")
    return host, int(port)


def _tls_files(tls: dict, config) -> tuple[dict, dict]:
    """The client's TLS files from the options, else from Dask's config; and where each came from.
    A key comes from the config only with the config's certificate."""
    files, origin = {}, {}
    for k in TLS_OPTIONS:
        if tls.get(k):
            files[k], origin[k] = str(tls[k]), TLS_OPTIONS[k]
        elif k == "key" and "cert" in tls:
            continue
        elif config is not None and config.get(TLS_CONFIG_KEYS[k], None):
            files[k], origin[k] = str(config.get(TLS_CONFIG_KEYS[k])), TLS_CONFIG_KEYS[k]
    return files, origin


def _check_tls_file(what: str, value: str) -> None:
    if "\n" in value:  # the PEM text itself (Dask's config allows it)
        return
    why = not_regular(value)
    if why:
        raise ConfigError(f"{what} {value}: {why}")
    if os.path.isdir(value):
        raise ConfigError(f"{what} {value}: is a folder, not a PEM file")
    try:
        with open(value, "rb"):
            pass
    except FileNotFoundError:
        raise ConfigError(f"{what} {value}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{what} {value}: cannot be read ({e.strerror})") from None


def parse_executor(executor: str, tls: dict | None = None, insecure: bool = False):
    """``"local"`` or the DaskTarget of ``executor``, checked without touching the network.

    Forms: ``local``; ``dask://HOST:PORT`` (TLS when TLS files are given or in Dask's config,
    else plain TCP); ``tls://HOST:PORT``; ``tcp://HOST:PORT`` (``dask://tls://…`` and
    ``dask://tcp://…`` too). ``tls`` holds the client's files: ``ca_file``, ``cert``, ``key``
    (the key may be in the cert file). Plain TCP to an address that is not loopback is refused
    unless ``insecure``: anyone who reaches the scheduler can run code here (docs/scale-out.md).
    """
    tls = {k: v for k, v in (tls or {}).items() if v}
    unknown = sorted(set(tls) - set(TLS_OPTIONS))
    if unknown:
        raise ValueError(f"unknown TLS setting {unknown[0]!r}")
    if executor == "local":
        given = [TLS_OPTIONS[k] for k in TLS_OPTIONS if k in tls] + (["--insecure"] if insecure else [])
        if given:
            raise ConfigError(f"{given[0]} applies to a Dask executor only (--executor dask://HOST:PORT)")
        return "local"
    dask_form = executor.startswith("dask://")
    rest = executor[len("dask://"):] if dask_form else executor
    scheme = None
    for s in ("tcp", "tls"):
        if rest.startswith(f"{s}://"):
            scheme, rest = s, rest[len(s) + 3:]
    if scheme is None and (not dask_form or "://" in rest):
        raise ConfigError(f"unknown executor '{executor}': use {_EXECUTOR_FORMS}")
    host, port = _split_address(executor, rest)
    try:
        import dask.config as config
        import distributed  # noqa: F401 - the package itself, not only a submodule imported before
        from distributed.security import Security
    except ImportError:
        raise ConfigError(f"--executor {executor} needs Dask's distributed scheduler: {DASK_INSTALL_HINT}") from None
    files, origin = _tls_files(tls, config if scheme != "tcp" else None)
    if scheme == "tcp" and tls:
        raise ConfigError(f"--executor {executor} is plain TCP but {origin[next(iter(tls))]} was given: "
                          f"use tls://{rest}")
    if scheme is None:
        scheme = "tls" if files else "tcp"
    hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if scheme == "tcp":
        if not is_loopback(host) and not insecure:
            raise ConfigError(
                f"--executor {executor}: refusing plain TCP to {host}, which is not loopback; anyone who can reach "
                "a Dask scheduler can run code on its workers and on this machine: give --tls-ca-file and --tls-cert "
                "(docs/scale-out.md), or --insecure on a network you trust")
        return DaskTarget(address=f"tcp://{hostport}", host=host)
    if insecure:
        raise ConfigError(f"--insecure has no effect with TLS (--executor {executor})")
    for k, what in (("ca_file", "the CA certificate that signed the cluster's certificates"),
                    ("cert", "this client's certificate, signed by a CA the scheduler trusts")):
        if k not in files:
            raise ConfigError(f"--executor {executor}: TLS needs {TLS_OPTIONS[k]} ({what}) or {TLS_CONFIG_KEYS[k]} "
                              "in Dask's config (docs/scale-out.md)")
    for k, v in files.items():
        _check_tls_file(origin[k], v)
    # all three given (the key may be None): Security would take what is missing from Dask's config
    kwargs = {"tls_ca_file": files["ca_file"], "tls_client_cert": files["cert"], "tls_client_key": files.get("key")}
    try:
        security = Security(require_encryption=True, **kwargs)
        security.get_connection_args("client")  # loads the CA, the certificate and the key now
    except ssl.SSLError as e:
        raise ConfigError(f"--executor {executor}: the TLS files ({', '.join(origin.values())}) do not load: "
                          f"{e.reason or e} (PEM files; the key must match the certificate)") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"--executor {executor}: TLS settings: {e}") from None
    return DaskTarget(address=f"tls://{hostport}", host=host, security=security)


def connect(target: DaskTarget, timeout_s: float):
    """A ``distributed.Client`` of the scheduler, or a one-line ConfigError."""
    try:
        from distributed import Client
    except ImportError:
        raise ConfigError(f"--executor {target.address} needs Dask's distributed scheduler: {DASK_INSTALL_HINT}") from None

    # Client's timeout bounds the TCP (and TLS) connection but not Dask's handshake after it
    # (distributed.comm.core.connect awaits the scheduler's handshake without a bound): a port that
    # accepts and never answers would hold Client() for ever. So the client is made in a thread of its
    # own and given up on after ``timeout_s`` in all; then its connection is abandoned (_abandon) so that
    # the thread, the client's IO loop and the socket all end.
    made: dict = {}

    class _Watched(Client):
        async def _start(self, *args, **kwargs):
            # the task that connects, on the client's own IO loop: what _abandon cancels
            made["pending"] = (self, asyncio.current_task())
            return await super()._start(*args, **kwargs)

    def make():
        try:
            made["client"] = _Watched(target.address, security=target.security, timeout=timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            made["error"] = e

    maker = threading.Thread(target=make, name="kvemu-dask-connect", daemon=True)
    maker.start()
    maker.join(timeout_s)
    if maker.is_alive():
        _abandon(made.get("pending"), maker)
        made.pop("error", None)
    if "client" in made:
        return made["client"]
    e = made.get("error")
    if e is None:
        raise ConfigError(f"cannot connect to the Dask scheduler at {target.address}: it accepted the connection but "
                          f"did not answer as a Dask scheduler within {timeout_s:g} s (is it one, "
                          "and on this port?)")
    # an error of Client(): OSError, TimeoutError, TLS refusals, AssertionError, all "cannot connect"
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    hint = ("; check that the scheduler's certificate is signed by the CA of --tls-ca-file, and --tls-cert by "
            "a CA the scheduler trusts" if target.tls else
            "; if it uses TLS, give --tls-ca-file, --tls-cert and --tls-key")
    raise ConfigError(f"cannot connect to the Dask scheduler at {target.address} ({' '.join(why.split())})"
                      f"{hint}") from None


def _abandon(pending, maker: threading.Thread) -> None:
    """End a client stuck in Dask's handshake: cancel the task that connects (on the client's own IO
    loop; the pending connection's socket is closed as it unwinds), let the connecting thread
    return, and close the client, which stops its loop's thread."""
    if pending is None:  # not connecting yet: no socket is held, and the thread is a daemon
        return
    client, task = pending
    try:
        client.loop.asyncio_loop.call_soon_threadsafe(task.cancel)
    except RuntimeError:  # the loop has closed already
        return
    maker.join(5)
    try:
        client.close(timeout=5)
    except Exception:  # noqa: BLE001 - a client that never connected: nothing left to report
        pass
