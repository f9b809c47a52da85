"""Two "nodes" on one machine for the multi-node tests, benchmarks and end-to-end drivers:
``e2e/netns_nodes.sh`` from Python, and the link's byte counts.

A node is a network namespace with its own mount, UTS and IPC namespaces (a private tmpfs
``/dev/shm``, its own hostname); the two are joined by a veth pair, the queue link
(10.77.0.1 and 10.77.0.2, fd77::1 and fd77::2), and optionally a second one for other traffic
(10.78.0.x). The test process itself stays in the host's namespaces: everything that talks over
the links runs as a child on one of the nodes (``TwoNodes.popen`` / ``TwoNodes.python``).

``TwoNodes(stranger=True)`` adds a third network namespace, the stranger (``STRANGER``, "s"):
a host that is not one of the queue's nodes, on its own veth link to node 0 (link ``"s"``,
10.79.0.1 on node 0, 10.79.0.2 on the stranger). It reaches node 0's addresses, the queue
link's 10.77.0.1 included (node 0 accepts a packet for any of its addresses on any interface),
but not node 1 (node 0 forwards nothing), and all its traffic is on link "s", counted there
(``counters()`` has node ``"s"`` too). ``python(STRANGER, ...)`` runs a child there (network
namespace only: the host's mounts).

    from netns import two_nodes_or_skip

    def test_remote_reader():
        with two_nodes_or_skip() as nodes:
            nodes.watch(5555)
            before = nodes.counters()
            reader = nodes.python(1, READER_CODE, "10.77.0.1", "5555")
            writer = nodes.python(0, WRITER_CODE, "5555")
            ...
            sent = nodes.counters() - before
            assert sent.tx(0, 5555) >= payload

``two_nodes_or_skip`` calls ``pytest.skip`` (with the reason) where the nodes cannot be made:
not root, no ``ip netns``, namespaces not permitted (an unprivileged container). Port counters
need ``nft``; ``TwoNodes.require_port_counters()`` skips where it is missing.

pytest is imported only by the two functions that skip, so scripts outside the test suite (the
two-node serve test) use ``TwoNodes`` without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "netns_nodes.sh"

#: The queue link's addresses by node (IPv4, IPv6), and the other link's.
QUEUE_ADDR = {0: "10.77.0.1", 1: "10.77.0.2"}
QUEUE_ADDR6 = {0: "fd77::1", 1: "fd77::2"}
OTHER_ADDR = {0: "10.78.0.1", 1: "10.78.0.2"}
#: The stranger (``TwoNodes(stranger=True)``) and its link's addresses (node 0's end, its own).
STRANGER = "s"
STRANGER_LINK_ADDR = {0: "10.79.0.1", STRANGER: "10.79.0.2"}

#: setns(2)'s namespace kinds (os.CLONE_* exist from Python 3.12 only).
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x40000000


def _setns_fd(fd: int, kind: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


#: Numbers the default prefixes of this process's node sets.
_SETS = itertools.count()

_LINE = re.compile(
    r"node=(?P<node>\d|s) link=(?P<link>\w) port=(?P<port>\w+) dir=(?P<dir>tx|rx) "
    r"bytes=(?P<bytes>\d+) packets=(?P<packets>\d+)"
)


def unavailable_reason() -> str | None:
    """Why two nodes cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian: iproute2, util-linux, mount)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` unavailable: {probe.stderr.strip() or probe.returncode}"
    # Root without CAP_SYS_ADMIN (a container) may not create namespaces.
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"namespaces not permitted here: {probe.stderr.strip() or probe.returncode}"
    return None


@dataclasses.dataclass(frozen=True)
class Counter:
    """Bytes and packets one counter saw (IP bytes for port counters)."""

    bytes: int
    packets: int


class Counters(dict):
    """Counter by ``(node, link, port, dir)``; ``node`` is 0, 1 or ``STRANGER``; ``port`` is a
    number, ``"tcp"`` (all TCP on the link) or ``"if"`` (the interface's own counters); ``dir``
    is ``"tx"`` or ``"rx"`` as seen by ``node``. ``later - earlier`` gives what happened in
    between."""

    def __sub__(self, earlier: Counters) -> Counters:
        zero = Counter(0, 0)
        return Counters(
            {
                k: Counter(
                    v.bytes - earlier.get(k, zero).bytes, v.packets - earlier.get(k, zero).packets
                )
                for k, v in self.items()
            }
        )

    def get_counter(self, node: int | str, port: int | str, dir: str, link: str = "q") -> Counter:
        key = (node, link, str(port), dir)
        if key not in self:
            raise KeyError(f"no counter for node {node} link {link} port {port} {dir}")
        return self[key]

    def tx(self, node: int | str, port: int | str, link: str = "q") -> int:
        """Bytes ``node`` sent on ``link`` from or to ``port``."""
        return self.get_counter(node, port, "tx", link).bytes

    def rx(self, node: int | str, port: int | str, link: str = "q") -> int:
        """Bytes ``node`` received on ``link`` from or to ``port``."""
        return self.get_counter(node, port, "rx", link).bytes


def parse_counters(text: str) -> Counters:
    """``netns_nodes.sh counters`` output as ``Counters``."""
    out = Counters()
    for line in text.splitlines():
        m = _LINE.fullmatch(line.strip())
        if m is None:
            raise ValueError(f"unexpected counters line: {line!r}")
        node = m["node"] if m["node"] == STRANGER else int(m["node"])
        key = (node, m["link"], m["port"], m["dir"])
        out[key] = Counter(int(m["bytes"]), int(m["packets"]))
    return out


class TwoNodes:
    """Two nodes made by ``e2e/netns_nodes.sh up`` and removed by ``down`` (also when used
    as a context manager). ``prefix`` names them (``<prefix>-n0``, ``<prefix>-n1``) so that
    sets do not collide (``up`` first removes a set of the same prefix); the default is unique
    to this object."""

    def __init__(
        self,
        *,
        prefix: str | None = None,
        rate: str | None = None,
        other_link: bool = False,
        ports: Sequence[int] = (),
        shm_size: str = "512m",
        private_tmp: bool = False,
        stranger: bool = False,
    ):
        self.prefix = prefix or f"vsat{os.getpid()}x{next(_SETS)}"
        self.rate = rate
        self.other_link = other_link
        self.ports = tuple(ports)
        self.shm_size = shm_size
        self.private_tmp = private_tmp
        self.stranger = stranger
        self.is_up = False
        #: This thread's own network namespace while ``enter(mount=False)`` moved it.
        self._home_net: int | None = None

    # ------------------------------------------------------------------ script
    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, PREFIX=self.prefix)
        env.update(extra)
        return env

    def _script(self, *args: str, check: bool = True, **extra_env: str) -> str:
        r = subprocess.run(
            ["bash", str(SCRIPT), *args],
            capture_output=True,
            text=True,
            env=self._env(**extra_env),
            timeout=60,
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"netns_nodes.sh {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}"
            )
        return r.stdout

    def up(self) -> TwoNodes:
        """Makes the nodes; raises ``RuntimeError`` with the script's message on failure (it
        then leaves nothing behind)."""
        env = {"SHM_SIZE": self.shm_size}
        if self.rate:
            env["RATE"] = self.rate
        if self.other_link:
            env["OTHER"] = "1"
        if self.private_tmp:
            env["PRIVATE_TMP"] = "1"
        if self.stranger:
            env["STRANGER"] = "1"
        if self.ports:
            env["PORTS"] = " ".join(str(p) for p in self.ports)
        self._script("up", **env)
        self.is_up = True
        return self

    def down(self) -> None:
        """Removes the nodes and ends anything still running on them (a thread that entered
        one with ``enter(mount=False)`` first goes back to its own namespace). Idempotent."""
        self.leave()
        self._script("down")
        self.is_up = False

    def __enter__(self) -> TwoNodes:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ addresses
    @staticmethod
    def addr(node: int | str, *, ipv6: bool = False, link: str = "q") -> str:
        """``node``'s address on the queue link (``link="q"``), the other link (``"o"``) or
        the stranger's link (``"s"``: node 0 or ``STRANGER``; the stranger has no other)."""
        if node == STRANGER or link == "s":
            if ipv6:
                raise ValueError("the stranger's link has no IPv6 address")
            return STRANGER_LINK_ADDR[node]
        if link == "o":
            if ipv6:
                raise ValueError("the other link has no IPv6 address")
            return OTHER_ADDR[node]
        return (QUEUE_ADDR6 if ipv6 else QUEUE_ADDR)[node]

    # ------------------------------------------------------------------ processes
    def node_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a node's child gets: ``env`` (default: this process's) with the
        repository on ``PYTHONPATH``, and without ``VLLM_SHM_ARENA_SHM_DIR``
        (a directory in the host's /dev/shm, which the node does not see; the node's own
        /dev/shm is private to it already). The script adds VSA_NODE, VLLM_HOST_IP and the
        GLOO/NCCL interface."""
        out = dict(os.environ if env is None else env)
        out.pop("VLLM_SHM_ARENA_SHM_DIR", None)
        out["PREFIX"] = self.prefix
        paths = [str(REPO)]
        if out.get("PYTHONPATH"):
            paths.append(out["PYTHONPATH"])
        out["PYTHONPATH"] = os.pathsep.join(paths)
        return out

    def popen(
        self, node: int | str, argv: Sequence[str], *, env: dict[str, str] | None = None, **kw
    ) -> subprocess.Popen:
        """Starts ``argv`` on ``node`` (0 or 1, or ``STRANGER`` when it is up) in the
        repository root; ``kw`` go to Popen."""
        if not self.is_up:
            raise RuntimeError("the nodes are not up")
        if node not in (0, 1) and not (node == STRANGER and self.stranger):
            raise ValueError(f"node must be 0 or 1 (or {STRANGER!r} with stranger), got {node!r}")
        kw.setdefault("cwd", str(REPO))
        return subprocess.Popen(
            ["bash", str(SCRIPT), "exec", str(node), *argv], env=self.node_env(env), **kw
        )

    def python(self, node: int | str, code: str, *args: str, **kw) -> subprocess.Popen:
        """Runs ``code`` (``python -c``) with this interpreter on ``node``; stdout and stderr
        are pipes (text) unless ``kw`` says otherwise."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        return self.popen(node, [sys.executable, "-c", code, *args], **kw)

    def enter(self, node: int, *, mount: bool = True) -> None:
        """Moves the calling process onto ``node``: its network namespace, and with ``mount``
        its mount, UTS and IPC namespaces too (its /dev/shm; then the working directory
        becomes ``/``). The network namespace alone changes only the calling thread, so any
        process may take it; the mount namespace needs a single-threaded process (a child
        right after fork)."""
        if not self.is_up:
            raise RuntimeError("the nodes are not up")
        if node not in (0, 1):
            raise ValueError(f"node must be 0 or 1, got {node!r}")
        state = f"/run/{self.prefix}-nodes"
        files = [(f"/run/netns/{self.prefix}-n{node}", CLONE_NEWNET)]
        if mount:
            # The mount namespace last: inside it the other namespace files are out of reach
            # (netns_nodes.sh unmounts their directory there), so all are opened first.
            files += [
                (f"{state}/n{node}.uts", CLONE_NEWUTS),
                (f"{state}/n{node}.ipc", CLONE_NEWIPC),
                (f"{state}/n{node}.mnt", CLONE_NEWNS),
            ]
        if not mount and self._home_net is None:
            self._home_net = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fds = []
        try:
            for path, _ in files:
                fds.append(os.open(path, os.O_RDONLY))
            for fd, (path, kind) in zip(fds, files, strict=True):
                _setns_fd(fd, kind, path)
        finally:
            for fd in fds:
                os.close(fd)

    def leave(self) -> None:
        """Takes the thread that called ``enter(mount=False)`` back to its own network
        namespace (``down`` would otherwise end it with the node). No-op otherwise."""
        if self._home_net is not None:
            fd, self._home_net = self._home_net, None
            try:
                _setns_fd(fd, CLONE_NEWNET, "the original network namespace")
            finally:
                os.close(fd)

    def partition(self, link: str = "q") -> None:
        """Drops every packet on ``link`` in both nodes, both ways, from now on (a silent
        partition: no reset, no ICMP; the sockets stay open). Needs nft."""
        ifname = "vsa-q" if link == "q" else "vsa-o"
        for n in (0, 1):
            rules = (
                f"add rule inet {self.prefix} in iifname {ifname} drop\n"
                f"add rule inet {self.prefix} out oifname {ifname} drop\n"
            )
            subprocess.run(
                ["ip", "netns", "exec", f"{self.prefix}-n{n}", "nft", "-f", "-"],
                input=rules,
                text=True,
                check=True,
                capture_output=True,
                timeout=30,
            )

    # ------------------------------------------------------------------ counters
    @property
    def has_port_counters(self) -> bool:
        """Whether per-port counters are available (``nft`` is installed)."""
        return shutil.which("nft") is not None

    def require_port_counters(self) -> None:
        """Skips the calling test when per-port counters are unavailable."""
        if not self.has_port_counters:
            import pytest

            pytest.skip("per-port byte counters need nft (Debian: apt-get install nftables)")

    def watch(self, *ports: int) -> None:
        """Counts TCP bytes from or to each of ``ports`` on every link, in both nodes (and
        the stranger)."""
        self._script("watch", *(str(p) for p in ports))

    def counters(self) -> Counters:
        """Every counter now (see ``Counters``)."""
        return parse_counters(self._script("counters"))


@contextlib.contextmanager
def two_nodes_or_skip(**kw) -> Iterator[TwoNodes]:
    """``TwoNodes(**kw)``, up for the ``with`` block, or ``pytest.skip`` with the reason where
    nodes cannot be made here. A failure of ``up`` where namespaces are permitted is a test
    failure, not a skip."""
    why = unavailable_reason()
    if why is not None:
        import pytest

        pytest.skip(why)
    with TwoNodes(**kw) as nodes:
        yield nodes


_BYTES = re.compile(r"bytes_acked:(\d+)")


def tcp_bytes_from_port(port: int) -> int | None:
    """Bytes the kernel delivered (acked) on the established TCP connections from local port
    ``port`` (``ss -ti``), in this process's network namespace; None where ``ss`` does not
    say. The loopback stand-in for a node's port counters."""
    try:
        out = subprocess.run(
            ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = _BYTES.findall(out)
    return sum(int(x) for x in found) if found else None


def port_of(addr: str) -> int:
    """The port of a ``tcp://host:port`` address."""
    return int(addr.rsplit(":", 1)[1])
