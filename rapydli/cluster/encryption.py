"""When a cluster's traffic is encrypted: CurveZMQ whenever its controller listens beyond loopback.

A controller that listens on ``127.0.0.1`` is reachable from this host only, and its
messages never leave it; a controller that listens on another address (``*`` for Slurm,
an interface's address for ssh hosts) is reachable by anyone on that network. There the
controller runs with ipyparallel's ``IPController.enable_curve``: it makes a CurveZMQ key
pair, writes its public key into the connection files, and the engines and the client
(ipyparallel reads the key from those files) encrypt and authenticate every message to it
(code, data, results). MPI traffic between ranks (gradients) is not ZeroMQ and is not
covered. CurveZMQ needs a pyzmq built with libsodium (the PyPI wheels are).

Examples
--------
>>> beyond_loopback("127.0.0.1"), beyond_loopback(None), beyond_loopback("*"), beyond_loopback("10.0.0.2")
(False, False, True, True)
"""

from __future__ import annotations

import ipaddress

from rapydli.errors import ClusterError


def beyond_loopback(controller_ip: str | None) -> bool:
    """True when a controller listening on ``controller_ip`` (``None``: ipyparallel's default, loopback)
    can be reached from other hosts."""
    if controller_ip in (None, "", "localhost"):
        return False
    if controller_ip == "*":
        return True
    try:
        return not ipaddress.ip_address(controller_ip).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it is meant to be reached from elsewhere
        return True


def curve_ready() -> bool:
    """True (the controller may encrypt); raises :class:`ClusterError` when this pyzmq has no CurveZMQ,
    rather than starting a controller other hosts could read in clear."""
    import zmq

    if not zmq.has("curve"):
        raise ClusterError(
            "this cluster's controller listens beyond loopback, where its traffic must be encrypted, but this pyzmq "
            f"({zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}) has no CurveZMQ: install pyzmq's PyPI wheel (built with libsodium)"
        )
    return True
