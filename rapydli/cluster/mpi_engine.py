"""The engine program of batch and ssh launches: this host's network checked, MPI initialised, then ipyparallel's engine.

**MPI first (Slurm).** Under ``srun --mpi=pmi2`` each engine reaches Slurm's PMI server
through an inherited file descriptor (``PMI_FD``). ipyparallel's engine opens and closes
many descriptors while it starts (sockets, its nanny, bytecode caches), and an engine
that initialised MPI only later, in its first task, was seen sending a ``.pyc`` file's
bytes to Slurm as PMI requests (``mpi/pmi2: invalid client request``, then UCX aborting on
a garbled address). Initialising MPI here, before anything else, uses the descriptor
while it is still the one srun passed.

**The interface as this host names it (ssh).** The ssh launcher's ``interface`` names an
interface of the notebook's machine, and with ``transport='tcp'`` MPI's TCP traffic is
pinned to it (``UCX_NET_DEVICES``, ``FI_TCP_IFACE``). A compute node rarely calls its
interface what the login node calls its own (``eth0`` against ``ib0`` or ``br0``), and MPI
aborted on such a host (UCX: "network device 'br0' is not available"). Before MPI starts,
:func:`interface_here` names instead the host's interface on the notebook machine's
network (:data:`PEER_VARIABLE`), and says so in the engine's log.

"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import MutableMapping

#: The engines' program: this module under the notebook's Python.
PROGRAM = (sys.executable, "-m", "rapydli.cluster.mpi_engine")
#: The notebook machine's address on the network the ``interface`` option names (set by the ssh launcher).
PEER_VARIABLE = "RAPYDLI_NETWORK_PEER"
#: The variables that pin MPI's TCP traffic to one interface (UCX; libfabric's tcp provider).
INTERFACE_VARIABLES = ("UCX_NET_DEVICES", "FI_TCP_IFACE")


def interface_here(environ: MutableMapping[str, str]) -> str:
    """Make :data:`INTERFACE_VARIABLES` name an interface this host has; say what changed ('' if nothing).

    A named interface that exists here is kept. One that does not is replaced by the
    interface whose IPv4 network holds ``environ[PEER_VARIABLE]``; without such an
    interface the variables are removed and MPI chooses.

    >>> env = {"FI_TCP_IFACE": "lo", "UCX_NET_DEVICES": "lo"}
    >>> interface_here(env), env["FI_TCP_IFACE"]
    ('', 'lo')
    >>> env = {"FI_TCP_IFACE": "nosuch0", PEER_VARIABLE: "127.0.0.2"}
    >>> interface_here(env).endswith("MPI uses 'lo', the interface on 127.0.0.2's network")
    True
    """
    import psutil

    named = {variable: environ[variable] for variable in INTERFACE_VARIABLES if environ.get(variable)}
    interfaces = psutil.net_if_addrs()
    missing = sorted({name for name in named.values() if name not in interfaces})
    if not missing:
        return ""
    peer = environ.get(PEER_VARIABLE, "")
    here = _interface_toward(peer, interfaces)
    for variable, name in named.items():
        if name in missing:
            if here:
                environ[variable] = here
            else:
                del environ[variable]
    said = f"[rapydli] interface {', '.join(map(repr, missing))} does not exist on {socket.gethostname()}: "
    if here:
        return said + f"MPI uses {here!r}, the interface on {peer}'s network"
    return said + f"MPI chooses its interfaces (none here is on {peer or 'the notebook machine'}'s network)"


def _interface_toward(peer: str, interfaces: dict[str, list]) -> str:
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return ""
    for name, entries in sorted(interfaces.items()):
        for entry in entries:
            if entry.family == socket.AF_INET and entry.netmask:
                if address in ipaddress.ip_network(f"{entry.address}/{entry.netmask}", strict=False):
                    return name
    return ""


if __name__ == "__main__":
    if said := interface_here(os.environ):
        sys.stderr.write(said + "\n")  # one write: Hydra prefixes what each write starts with its host
    from ipyparallel.engine.app import main
    from mpi4py import MPI  # noqa: F401 - MPI_Init_thread runs at import

    main()
