"""Which network interface NCCL and Gloo will use, and whether it agrees with what Ray advertises.

The recipe: ``NCCL_SOCKET_IFNAME=ib0`` when that interface exists, else
``^lo,docker0``. NCCL reads the variable as a list of name prefixes (``^``
excludes, ``=`` means exact); Gloo needs one exact name in
``GLOO_SOCKET_IFNAME``. slurm/prelude.sh sets both; these checks read them back.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Mapping

from .checks import FAIL, PASS, WARN, Row, node_name
from .rendezvous import ResolveError, resolve_ipv4


@dataclass
class Interface:
    name: str
    ipv4: str | None
    network: ipaddress.IPv4Network | None
    up: bool


def interfaces() -> dict[str, Interface]:
    """This node's interfaces with their first IPv4 address."""
    import psutil

    stats = psutil.net_if_stats()
    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = next((a for a in addrs if a.family == socket.AF_INET), None)
        net = ipaddress.IPv4Interface(f"{v4.address}/{v4.netmask}").network if v4 and v4.netmask else None
        out[name] = Interface(
            name, v4.address if v4 else None, net, bool(stats.get(name) and stats[name].isup)
        )
    return out


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces an NCCL_SOCKET_IFNAME value selects, in NCCL's order (ib* first)."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    wanted = [w for w in (body[1:] if exact else body).split(",") if w]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    chosen = [n for n in names if hit(n) != exclude]
    return sorted(chosen, key=lambda n: (not n.startswith("ib"), n))


def default_route_interface() -> str | None:
    try:
        with open("/proc/net/route") as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if len(fields) > 1 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def chosen_interface(
    env: Mapping[str, str] | None = None, ifaces: dict[str, Interface] | None = None
) -> Interface | None:
    """The interface collectives will use: GLOO_SOCKET_IFNAME, else NCCL's pick, else ib*/default route."""
    env = os.environ if env is None else env
    ifaces = interfaces() if ifaces is None else ifaces
    up = [n for n, i in ifaces.items() if i.up and i.ipv4]
    if env.get("GLOO_SOCKET_IFNAME"):
        return ifaces.get(env["GLOO_SOCKET_IFNAME"].split(",")[0])
    if env.get("NCCL_SOCKET_IFNAME"):
        picked = nccl_matches(env["NCCL_SOCKET_IFNAME"], up)
        return ifaces[picked[0]] if picked else None
    ib = sorted(n for n in up if n.startswith("ib"))
    name = ib[0] if ib else default_route_interface()
    return ifaces.get(name) if name else None


def check_interface(
    gpu_run: bool,
    loopback_ok: bool,
    env: Mapping[str, str] | None = None,
    ifaces: dict[str, Interface] | None = None,
) -> Row:
    """NCCL/Gloo interface: exists, is InfiniBand on GPU runs, is not loopback across hosts."""
    env = os.environ if env is None else env
    ifaces = interfaces() if ifaces is None else ifaces
    have = ", ".join(sorted(n for n, i in ifaces.items() if i.up))
    setting = "; ".join(f"{k}={env[k]}" for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if env.get(k))
    name = "network interface"
    chosen = chosen_interface(env, ifaces)
    if chosen is None:
        return Row(
            name,
            FAIL,
            f"{setting or 'no setting'} selects no interface (up: {have})",
            "an existing interface",
            "unset NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME or name one that exists "
            "here; slurm/prelude.sh picks ib0 when present, else ^lo,docker0",
            node_name(),
        )
    measured = f"{chosen.name} ({chosen.ipv4})" + (f" via {setting}" if setting else "")
    if chosen.name == "lo" and not loopback_ok:
        return Row(
            name,
            FAIL,
            measured,
            "an interface that reaches the other nodes",
            "loopback cannot reach other hosts: export NCCL_SOCKET_IFNAME=^lo,docker0",
            node_name(),
        )
    if gpu_run and not chosen.name.startswith("ib"):
        return Row(
            name,
            WARN,
            measured + "; no ib* interface",
            "ib* (InfiniBand) for inter-node traffic",
            "check the IB driver/IPoIB (ibstat, ip link); over Ethernet expect far less all-reduce bandwidth",
            node_name(),
        )
    return Row(name, PASS, measured, "ib* preferred, else ^lo,docker0", "", node_name())


def check_advertised_ip(
    ip: str, env: Mapping[str, str] | None = None, ifaces: dict[str, Interface] | None = None
) -> Row:
    """The IP Ray and vLLM advertise must be this node's and on the interface NCCL/Gloo use."""
    ifaces = interfaces() if ifaces is None else ifaces
    chosen = chosen_interface(env, ifaces)
    name = "advertised ip"
    addr = ipaddress.IPv4Address(ip)
    owner = next((i for i in ifaces.values() if i.ipv4 == ip), None) or next(
        (i for i in ifaces.values() if i.network and i.name == "lo" and addr in i.network), None
    )
    if owner is None:
        return Row(
            name,
            FAIL,
            f"{ip} is not an address of this node",
            "an IPv4 of this node",
            "start Ray with --node-ip-address set to this node's IP (slurm/prelude.sh exports NODE_IP)",
            node_name(),
        )
    measured = f"Ray/vLLM advertise {ip} ({owner.name}); NCCL/Gloo use {chosen.name if chosen else '?'}"
    if chosen and owner.name != chosen.name:
        return Row(
            name,
            WARN,
            measured,
            "the same interface",
            f"export NCCL_SOCKET_IFNAME={owner.name} GLOO_SOCKET_IFNAME={owner.name}, or advertise "
            f"{chosen.ipv4} (NODE_IP) so control and data traffic share one network",
            node_name(),
        )
    return Row(name, PASS, measured, "the same interface", "", node_name())


def check_resolution(hosts: list[str], env: Mapping[str, str] | None = None) -> Row:
    """Every node name of the job resolves to IPv4 from this node."""
    seen, errors, via_slurm = [], [], []
    for host in hosts:
        try:
            ip, how = resolve_ipv4(host, env)
            seen.append(f"{host}→{ip}")
            if how != "dns":
                via_slurm.append(host)
        except ResolveError as err:
            errors.append(str(err))
    measured = ", ".join(seen) or "-"
    name = "host resolution"
    if errors:
        return Row(
            name,
            FAIL,
            "; ".join(errors),
            "every node name resolves",
            "add the nodes to DNS or /etc/hosts on every node (ask the admins)",
            node_name(),
        )
    if via_slurm:
        return Row(
            name,
            WARN,
            measured + f" ({', '.join(via_slurm)} only through Slurm's NodeAddr)",
            "every node name resolves by DNS",
            "add the node names to DNS or /etc/hosts: Ray, vLLM and "
            "ssh do not ask Slurm (dsr1kit uses the NodeAddr IPs)",
            node_name(),
        )
    return Row(name, PASS, measured, "every node name resolves", "", node_name())
