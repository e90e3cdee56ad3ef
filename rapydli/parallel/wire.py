"""Moving activations and gradients between neighbouring stages with tagged non-blocking MPI.

A payload is a tensor, or a tuple of tensors (``None`` allowed: a gradient that does not
exist). Nothing is assumed static: every transfer first sends a small header (pickled
``(dtype, shape, requires_grad)`` per item), then each tensor's bytes with ``Isend`` on
the same tag; MPI keeps messages of one sender and tag in order, so the receiver posts
``Irecv`` into tensors allocated from the header. Any dtype works (bytes are sent as
``MPI.BYTE``). Waits test the requests with short sleeps, so a waiting rank gives its
core to others on an oversubscribed node and a SIGINT (the notebook interrupting a
failed run) ends the wait.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from mpi4py import MPI

from rapydli.cluster import trace

#: Tests before the first sleep while waiting, and the sleeps' first and longest length (s).
SPINS, FIRST_SLEEP, LONGEST_SLEEP = 200, 20e-6, 500e-6

KINDS = {"activation": 0, "gradient": 1}


def tag(kind: str, microbatch: int, data: bool) -> int:
    """The MPI tag of ``kind``'s header (``data=False``) or bytes for ``microbatch``."""
    return (microbatch * 2 + KINDS[kind]) * 2 + int(data)


def _flat_bytes(t: torch.Tensor) -> Any:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def isend(comm: Any, payload: Any, dest: int, kind: str, microbatch: int) -> list[tuple[Any, Any]]:
    """Start sending ``payload`` to ``dest``; returns ``(request, buffer)`` pairs to keep until done."""
    items = payload if isinstance(payload, tuple) else (payload,)
    header = (
        isinstance(payload, tuple),
        [
            None if t is None else (str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(t.requires_grad))
            for t in items
        ],
    )
    pending = [(comm.isend(header, dest=dest, tag=tag(kind, microbatch, False)), header)]
    for t in items:
        if t is not None and t.numel():
            buffer = _flat_bytes(t.cpu())
            pending.append((comm.Isend([buffer, MPI.BYTE], dest=dest, tag=tag(kind, microbatch, True)), buffer))
    _trace("send", comm, comm.Get_rank(), dest, sum(t.numel() * t.element_size() for t in items if t is not None))
    return pending


def recv(comm: Any, source: int, kind: str, microbatch: int, device: torch.device) -> Any:
    """Receive what :func:`isend` sent (waiting politely); float tensors of activations require grad."""
    token = _trace("recv", comm, source, comm.Get_rank(), 0)
    try:
        return _recv(comm, source, kind, microbatch, device)
    finally:
        trace.end(token)


def _trace(kind: str, comm: Any, source: int, dest: int, nbytes: int) -> int:
    """Record a send (posted, so ended at once) or the start of a receive in the collective trace."""
    if not trace.recording():
        return -1
    group = trace.group_label(comm)
    peer = dest if kind == "send" else source
    token = trace.begin(kind, group, nbytes, "", peer, trace.p2p_channel(group, source, dest))
    if kind == "send":
        trace.end(token)
    return token


def _recv(comm: Any, source: int, kind: str, microbatch: int, device: torch.device) -> Any:
    packed, specs = wait(comm.irecv(source=source, tag=tag(kind, microbatch, False)))
    items: list[torch.Tensor | None] = []
    requests = []
    for spec in specs:
        if spec is None:
            items.append(None)
            continue
        dtype, shape, _ = spec
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if t.numel():
            requests.append(comm.Irecv([_flat_bytes(t), MPI.BYTE], source=source, tag=tag(kind, microbatch, True)))
        items.append(t)
    wait_all(requests)
    out: list[torch.Tensor | None] = []
    for item, spec in zip(items, specs):
        if item is not None:
            item = item.to(device)
            if kind == "activation" and spec[2] and item.is_floating_point():
                item.requires_grad_(True)
        out.append(item)
    return tuple(out) if packed else out[0]


def wait(request: Any) -> Any:
    """Wait for one request (politely, interruptibly); returns its value (lowercase requests)."""
    spins, pause = 0, FIRST_SLEEP
    while True:
        done, value = request.test()
        if done:
            return value
        spins += 1
        if spins >= SPINS:
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_SLEEP)


def wait_all(requests: Sequence[Any]) -> None:
    """Wait for buffer requests (``Isend``/``Irecv``), politely and interruptibly."""
    requests = list(requests)
    spins, pause = 0, FIRST_SLEEP
    while requests and not MPI.Request.Testall(requests):
        spins += 1
        if spins >= SPINS:
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_SLEEP)
