"""Emulated test hosts on one Linux machine: network namespaces on a bridge, links shaped with ``tc``.

Used by ``gradcompress netbench``. A :class:`Testbed` with N hosts builds::

    namespace gcnb-<pid>-<tag>-br   bridge "gcbr" + one port "p<i>" per host
    namespace gcnb-<pid>-<tag>-h<i> veth "gcveth" (peer of p<i>), address 10.213.0.<i+1>/24

Nothing is added to the root namespace (the veth pairs are created inside the bridge
namespace and one end is moved into the host's namespace), and the addresses exist only
inside these namespaces. Each host's link is shaped in both directions like a full-duplex
NIC: ``tbf`` (token bucket) at ``rate`` on the host's egress (``gcveth``) and on the
bridge port's egress towards the host (``p<i>``); ``netem delay`` (one-way latency) on
the host's egress when a delay is asked for (``tbf`` root, ``netem`` as its child). IPv6
is switched off in the host namespaces so that only the processes' own traffic (and ARP)
crosses the links.

:meth:`Testbed.spawn` starts a process inside a host namespace (``ip netns exec NS
argv...``; ``ip`` execs the command, so the returned ``Popen`` is that process).
:meth:`Testbed.down` kills the processes it started (by pid, then any process still in
its namespaces) and deletes the namespaces, which deletes the veth pairs and the bridge
with them; it is idempotent, never raises, and blocks SIGINT/SIGTERM while it runs.
:func:`cleanup_stale` removes what a crashed run (a process killed with SIGKILL) left
behind: namespaces named ``gcnb-<pid>-...`` whose pid no longer exists.

Needs root, ``ip`` and ``tc`` (iproute2); :func:`problem` says in one line what is missing.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from typing import Any, cast

PREFIX = "gcnb"
SUBNET = "10.213.0"  # private range, used only inside the namespaces created here
PREFIX_LEN = 24
HOST_IFNAME = "gcveth"
BRIDGE = "gcbr"
MAX_HOSTS = 250
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]+)-(br|h\d+)$")


class NetnsError(RuntimeError):
    """A setup command failed; the message is one line (the command and its error)."""


# --------------------------------------------------------------------------- environment
def problem() -> str | None:
    """None when namespaces can be built here, else a one-line reason (not root, no ip/tc)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc need CAP_NET_ADMIN); run it as root, e.g. with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} from iproute2, not found on PATH (install the iproute2 package)"
    return None


def probe() -> str | None:
    """:func:`problem`, then try ``ip netns add`` (and delete) once; None when it works, else why not."""
    why = problem()
    if why:
        return why
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-h0"
    try:
        _run(["ip", "netns", "add", name])
    except NetnsError as err:
        return f"cannot create a network namespace here ({err})"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def netem_available(ns: str | None = None) -> bool:
    """True when the kernel has the ``netem`` qdisc (needed for a link delay)."""
    own = ns is None
    ns = ns or f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-h0"
    try:
        if own:
            _run(["ip", "netns", "add", ns])
        r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return r.returncode == 0
    except NetnsError:
        return False
    finally:
        if own:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        msg = " ".join((r.stderr or r.stdout or f"exit code {r.returncode}").split())
        raise NetnsError(f"'{' '.join(cmd)}' failed: {msg}")
    return r


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns list`` shows."""
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def ours(names: list[str] | None = None) -> list[str]:
    """The namespaces that look like a Testbed's (``gcnb-<pid>-<tag>-...``)."""
    return [n for n in (list_namespaces() if names is None else names) if _NAME_RE.match(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(ns: str) -> list[int]:
    r = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still running in ``ns`` (only ever a Testbed's own namespaces)."""
    for pid in namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _delete_namespaces(names: list[str]) -> list[str]:
    """Kill what runs inside, delete hosts first then the bridge; return the errors (one line each)."""
    errors = []
    for ns in sorted(names, key=lambda n: n.endswith("-br")):
        _kill_namespace_processes(ns)
    for ns in sorted(names, key=lambda n: n.endswith("-br")):
        r = _run(["ip", "netns", "del", ns], check=False)
        if r.returncode != 0 and ns in list_namespaces():
            errors.append(f"ip netns del {ns}: {' '.join(r.stderr.split())}")
    return errors


def cleanup_stale() -> list[str]:
    """Delete namespaces left by Testbeds whose process is gone (a crashed run); return their names."""
    stale = []
    for ns in ours():
        pid = int(cast(re.Match, _NAME_RE.match(ns)).group(1))  # ours(): names that match
        if pid != os.getpid() and not _pid_alive(pid):
            stale.append(ns)
    if stale:
        _delete_namespaces(stale)
    return stale


# --------------------------------------------------------------------------- the testbed
def tbf_burst_bytes(rate_bit: float) -> int:
    """Token-bucket depth: 1 ms at the rate, at least 64 KiB (one GSO packet must fit)."""
    return max(64 * 1024, int(rate_bit / 8 * 1e-3))


def tc_rate(rate_bit: float) -> str:
    """``rate_bit`` (bit/s) in tc's own notation: ``bit`` (tc reads ``bps`` as BYTES per second, so a rate parsed by
    :func:`gradcompress.timing.parse_rate` is never handed to tc as the user spelt it)."""
    return f"{round(rate_bit)}bit"


def tbf(rate_bit: float) -> list[str]:
    """The ``tbf`` qdisc arguments that shape a link to ``rate_bit`` bit/s (every tc command of the testbed)."""
    return ["tbf", "rate", tc_rate(rate_bit), "burst", str(tbf_burst_bytes(rate_bit)), "latency", "100ms"]


class Testbed:
    """N hosts (namespaces) on one bridge, each link shaped; see the module docstring.

    Args:
        hosts: number of hosts (1 to 250).
        rate_bit: link rate in bits/s in each direction (None: unshaped).
        delay_s: one-way delay added on each host's egress (netem; 0: none).
        mtu: MTU of the links (default 1500, Ethernet).
    """

    def __init__(self, hosts: int, rate_bit: float | None = None, delay_s: float = 0.0, mtu: int = 1500):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1 to {MAX_HOSTS}, got {hosts}")
        self.hosts = hosts
        self.rate_bit = rate_bit
        self.delay_s = delay_s
        self.mtu = mtu
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-br"
        self.host_ns = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.ifname = HOST_IFNAME
        self.procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._down = False

    # ----------------------------------------------------------------- setup
    def up(self) -> Testbed:
        """Build the namespaces, bridge, links and qdiscs; on failure tear down and raise NetnsError."""
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _ns_add(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _up(self) -> None:
        br = self.bridge_ns
        self._ns_add(br)
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        shape = None if self.rate_bit is None else tbf(self.rate_bit)
        for i, (ns, addr) in enumerate(zip(self.host_ns, self.addresses)):
            self._ns_add(ns)
            for key in ("all", "default"):
                path = f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6"
                _run(["ip", "netns", "exec", ns, "sh", "-c", f"test -e {path} && echo 1 > {path} || true"])
            port = f"p{i}"
            _run(["ip", "-n", br, "link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer", "name",
                  self.ifname, "mtu", str(self.mtu), "netns", ns])
            _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", self.ifname])
            if shape:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", self.ifname, "root", "handle", "1:", *shape])
                _run(["tc", "-n", br, "qdisc", "add", "dev", port, "root", "handle", "1:", *shape])
            if self.delay_s > 0:
                parent = ["parent", "1:1"] if shape else ["root"]
                delay = f"{self.delay_s * 1e6:.0f}us"
                try:
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", self.ifname, *parent, "handle", "10:", "netem",
                          "delay", delay, "limit", "100000"])
                except NetnsError as err:
                    if "unknown" in str(err).lower():
                        raise NetnsError("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no link "
                                         "delay can be emulated; run without --latency") from None
                    raise
            _run(["ip", "-n", br, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", self.ifname, "up"])

    # ----------------------------------------------------------------- processes
    def spawn(self, host: int, argv: list[str], env: dict | None = None, **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace; the process is killed by :meth:`down`."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.host_ns[host], *argv], env=env, **popen_kwargs)
        self.procs.append(proc)
        return proc

    def tx_bytes(self, host: int) -> int:
        """Bytes host ``host``'s link interface has transmitted (read inside its namespace)."""
        r = _run(["ip", "netns", "exec", self.host_ns[host], "cat",
                  f"/sys/class/net/{self.ifname}/statistics/tx_bytes"])
        return int(r.stdout.strip())

    # ----------------------------------------------------------------- teardown
    def down(self, grace: float = 3.0) -> list[str]:
        """Stop the processes and delete everything; returns the errors (normally none). Idempotent."""
        if self._down:
            return []
        blocked = {signal.SIGINT, signal.SIGTERM}
        try:
            old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        except (ValueError, OSError):  # not the main thread's business, or no signals here
            old = None
        try:
            for p in self.procs:
                if p.poll() is None:
                    try:
                        p.terminate()
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    try:
                        p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
            present = set(list_namespaces())
            errors = _delete_namespaces([ns for ns in self._created if ns in present])
            self._down = True
            return errors
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


__all__ = ["NetnsError", "Testbed", "cleanup_stale", "list_namespaces", "netem_available", "ours", "probe",
           "problem", "tbf", "tbf_burst_bytes", "tc_rate", "PREFIX", "SUBNET", "HOST_IFNAME"]
