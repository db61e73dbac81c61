"""A small cluster fabric on one machine: one network namespace per node, two networks, as real clusters have.

Every node gets its own namespace with two veth interfaces, each on a bridge in the root namespace:

- ``mgmt0`` on the management network (agent <-> coordinator gRPC; the coordinator listens on that bridge's
  address in the root namespace), and
- ``data0`` on the data network (the workers' collectives: ``GLOO_SOCKET_IFNAME=data0``, and the rendezvous
  store of rank 0).

Taking a node's data link down (its host-side veth) cuts its collectives while its agent can still reach the
coordinator, which is how a RoCE NIC or switch-port failure looks on a cluster whose front-end network is separate;
the node agent's RoCE detector sees the carrier drop over netlink inside the namespace.

Commands go through ``ip`` (iproute2), which every node that runs this has; all names carry a random tag so
concurrent drills and tests never collide, and :meth:`Fabric.close` removes everything, even after a failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from dataclasses import dataclass

from trainguard.drill.errors import SoakError


@dataclass(frozen=True)
class NodeNet:
    """One node's place on the fabric.

    Attributes:
        node: node id.
        netns: namespace name (run the node's processes under ``ip netns exec <netns>``).
        mgmt_ip: its address on the management network.
        data_ip: its address on the data network (what it advertises to the coordinator).
        data_host_veth: the root-namespace end of its data link (set down to cut the link).
        mgmt_host_veth: the root-namespace end of its management link.
    """

    node: str
    netns: str
    mgmt_ip: str
    data_ip: str
    data_host_veth: str
    mgmt_host_veth: str


def netns_unavailable_reason() -> str | None:
    """Why network namespaces cannot be built here, or None when they can.

    Returns:
        A one-line reason (not root, no ``ip``, namespaces refused), or None.
    """
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"tgprobe{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    if r.returncode:
        return f"network namespaces not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode:
        raise SoakError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}; the drill needs root and iproute2 "
                        "(or run it with --no-netns)")


def _prefixes_in_use() -> set[str]:
    """The first three octets of every IPv4 address of this namespace's interfaces."""
    import psutil

    return {a.address.rsplit(".", 1)[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET}


class Fabric:
    """Two bridges (management, data) and a namespace per node. Use as a context manager."""

    def __init__(self) -> None:
        # Subnets drawn at random: another fabric of the host (a second drill, a test beside this one) could hold
        # one of them, and two bridges on one /24 misroute each other's traffic; a draw in use is drawn again.
        taken = _prefixes_in_use()
        for _ in range(100):
            self.tag = uuid.uuid4().hex[:5]
            a = 20 + int(self.tag[:2], 16) % 200
            b = int(self.tag[2:4], 16)
            self._subnets = {"mgmt": f"10.{a}.{b}", "data": f"10.{a + 1}.{b}"}
            if not taken & set(self._subnets.values()):
                break
        self._bridges = {"mgmt": f"tgM{self.tag}", "data": f"tgD{self.tag}"}
        self.nodes: dict[str, NodeNet] = {}
        self._count = 0
        self._up = False

    @property
    def coordinator_host(self) -> str:
        """Address the coordinator listens on: the management bridge's, in the root namespace."""
        return f"{self._subnets['mgmt']}.1"

    def __enter__(self) -> Fabric:
        try:
            for i, (net, br) in enumerate(self._bridges.items()):
                # A bridge takes the lowest MAC of its ports unless it has its own; every node joining or leaving
                # would then change the gateway's MAC and silence the whole network until ARP caches expire.
                mac = f"02:74:67:{int(self.tag[:2], 16):02x}:{int(self.tag[2:4], 16):02x}:{i:02x}"
                _sh("ip", "link", "add", br, "address", mac, "type", "bridge")
                _sh("ip", "addr", "add", f"{self._subnets[net]}.1/24", "dev", br)
                _sh("ip", "link", "set", br, "up")
        except SoakError:
            self.close()
            raise
        self._up = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, node: str) -> NodeNet:
        """Creates ``node``'s namespace with its two links.

        Args:
            node: node id (unique on this fabric).

        Returns:
            Its addresses and interface names.

        Raises:
            SoakError: an ``ip`` command failed.
        """
        k = self._count
        self._count += 1
        ns = f"tg{self.tag}n{k}"
        ips = {}
        hosts = {}
        _sh("ip", "netns", "add", ns)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        for net in ("mgmt", "data"):
            host, peer = f"tg{net[0]}{self.tag}h{k}", f"tg{net[0]}{self.tag}p{k}"
            ip = f"{self._subnets[net]}.{10 + k}"
            _sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", peer, "netns", ns)
            _sh("ip", "link", "set", host, "master", self._bridges[net])
            _sh("ip", "link", "set", host, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "name", f"{net}0")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", f"{net}0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", f"{net}0", "up")
            ips[net], hosts[net] = ip, host
        net_ = NodeNet(node, ns, ips["mgmt"], ips["data"], hosts["data"], hosts["mgmt"])
        self.nodes[node] = net_
        return net_

    def link_down(self, node: str) -> None:
        """Takes ``node``'s data link down (the switch side of its NIC): its collectives stop, its agent lives."""
        _sh("ip", "link", "set", self.nodes[node].data_host_veth, "down")

    def remove(self, node: str) -> None:
        """Deletes ``node``'s links and namespace (the node left the cluster)."""
        n = self.nodes.pop(node, None)
        if n is None:
            return
        for host in (n.data_host_veth, n.mgmt_host_veth):
            subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "netns", "del", n.netns], capture_output=True)

    def close(self) -> None:
        """Removes every namespace, link and bridge this fabric made."""
        for node in list(self.nodes):
            self.remove(node)
        for br in self._bridges.values():
            subprocess.run(["ip", "link", "del", br], capture_output=True)
        self._up = False
