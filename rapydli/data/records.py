"""The binary record of one sample, and the schema every record of a store follows.

A sample is a tensor, a numpy array, ``bytes`` (an encoded image, say), ``str``, ``int``
or ``float``, or a tuple, list or dict of those (one level). Its schema, inferred from
the first sample and stored in the store's header, names the container and each field's
kind, dtype and shape; every other sample must match it.

Record layout (little endian)::

    b"RPD1" | crc32(payload): u32 | field count: u32 | field lengths: u64 * count | payload

so a truncated, corrupted or foreign record is detected when it is read.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Any

import numpy as np
import torch

from rapydli.errors import DataError

MAGIC = b"RPD1"
_PREFIX = struct.Struct("<4sII")


def _field_schema(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    if isinstance(value, np.ndarray):
        return {"kind": "ndarray", "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, (bytes, bytearray)):
        return {"kind": "bytes"}
    if isinstance(value, str):
        return {"kind": "str"}
    if isinstance(value, (bool, np.bool_)):
        return {"kind": "bool"}
    if isinstance(value, (int, np.integer)):
        return {"kind": "int"}
    if isinstance(value, (float, np.floating)):
        return {"kind": "float"}
    raise DataError(
        f"cannot store a field of type {type(value).__name__}: allowed are tensor, ndarray, bytes, str, int, float, bool"
    )


def infer_schema(sample: Any) -> dict[str, Any]:
    """The schema of ``sample``.

    Examples
    --------
    >>> infer_schema((torch.zeros(2, dtype=torch.uint8), 3))
    {'container': 'tuple', 'fields': [{'kind': 'tensor', 'dtype': 'uint8', 'shape': [2]}, {'kind': 'int'}]}
    """
    if isinstance(sample, dict):
        return {
            "container": "dict",
            "keys": [str(k) for k in sample],
            "fields": [_field_schema(v) for v in sample.values()],
        }
    if isinstance(sample, (tuple, list)):
        return {"container": type(sample).__name__, "fields": [_field_schema(v) for v in sample]}
    return {"container": "single", "fields": [_field_schema(sample)]}


def _fields(sample: Any) -> list[Any]:
    if isinstance(sample, dict):
        return list(sample.values())
    if isinstance(sample, (tuple, list)):
        return list(sample)
    return [sample]


def _encode_field(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bool, np.bool_)):
        return struct.pack("<?", bool(value))
    if isinstance(value, (int, np.integer)):
        return struct.pack("<q", int(value))
    return struct.pack("<d", float(value))


def encode(sample: Any, schema: dict[str, Any], where: str) -> bytes:
    """The record of ``sample``; ``DataError`` naming ``where`` if it does not match ``schema``."""
    found = infer_schema(sample)
    if found != schema:
        raise DataError(f"{where} does not match the store's schema: {found} != {schema}")
    parts = [_encode_field(v) for v in _fields(sample)]
    payload = b"".join(parts)
    head = _PREFIX.pack(MAGIC, zlib.crc32(payload), len(parts)) + struct.pack(f"<{len(parts)}Q", *map(len, parts))
    return head + payload


def _fixed_size(field: dict[str, Any]) -> int | None:
    if field["kind"] in ("tensor", "ndarray"):
        itemsize = (
            torch.empty(0, dtype=getattr(torch, field["dtype"])).element_size()
            if field["kind"] == "tensor"
            else np.dtype(field["dtype"]).itemsize
        )
        return itemsize * math.prod(field["shape"])
    return {"int": 8, "float": 8, "bool": 1}.get(field["kind"])


def _decode_field(field: dict[str, Any], data: memoryview, copy: bool) -> Any:
    kind = field["kind"]
    if kind == "tensor":
        array = np.frombuffer(data, dtype=np.uint8)
        return (
            torch.from_numpy(array.copy() if copy else array)
            .view(getattr(torch, field["dtype"]))
            .reshape(field["shape"])
        )
    if kind == "ndarray":
        array = np.frombuffer(data, dtype=np.dtype(field["dtype"])).reshape(field["shape"])
        return array.copy() if copy else array
    if kind == "bytes":
        return bytes(data)
    if kind == "str":
        return bytes(data).decode()
    if kind == "bool":
        return struct.unpack("<?", data)[0]
    if kind == "int":
        return struct.unpack("<q", data)[0]
    return struct.unpack("<d", data)[0]


def decode(
    record: bytes | memoryview, schema: dict[str, Any], where: str, check: bool = True, copy: bool = True
) -> Any:
    """The sample in ``record``; ``DataError`` naming ``where`` if it is truncated, corrupt or off-schema.

    ``check=False`` skips the checksum, and ``copy=False`` returns tensors and arrays that
    are views of a writable ``record`` (for records a loader wrote to its own cache).
    """
    view = memoryview(record)
    fields = schema["fields"]
    if len(view) < _PREFIX.size:
        raise DataError(f"{where} is truncated: {len(view)} bytes, a record has at least {_PREFIX.size}")
    magic, crc, count = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise DataError(f"{where} is not a RaPyDLI record (magic {bytes(magic)!r})")
    if count != len(fields):
        raise DataError(f"{where} does not match the store's schema: {count} fields, the schema has {len(fields)}")
    start = _PREFIX.size + 8 * count
    if len(view) < start:
        raise DataError(f"{where} is truncated: its field table is cut off")
    lengths = struct.unpack_from(f"<{count}Q", view, _PREFIX.size)
    if len(view) != start + sum(lengths):
        raise DataError(f"{where} is truncated or padded: {len(view)} bytes, its header says {start + sum(lengths)}")
    payload = view[start:]
    if check and zlib.crc32(payload) != crc:
        raise DataError(f"{where} is corrupt: its checksum does not match")
    values = []
    offset = 0
    for field, length in zip(fields, lengths):
        expected = _fixed_size(field)
        if expected is not None and length != expected:
            raise DataError(
                f"{where} does not match the store's schema: a {field} field of {length} bytes, expected {expected}"
            )
        values.append(_decode_field(field, payload[offset : offset + length], copy))
        offset += length
    container = schema["container"]
    if container == "dict":
        return dict(zip(schema["keys"], values))
    if container == "single":
        return values[0]
    return tuple(values) if container == "tuple" else values
