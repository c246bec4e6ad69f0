"""How Mooncake's tensor API lays a tensor out in one store object, and safetensors files.

A tensor object is ``[TensorMetadata][data]``: a 304-byte little-endian header, then the
tensor's bytes in row-major (contiguous) order. The header is Mooncake's own, byte for byte, so
a buffer ``get_tensor_into`` filled can be stored again with ``put_tensor_from`` (Mooncake
documents that round trip), and objects written through either implementation read back through
the other:

* object header, 40 bytes: magic ``0x4d4f4f4e``, version 1 (u16), header size 304 (u16), dtype
  (i32, Mooncake's numbering: :data:`DTYPE_NAMES`), ndim (i32, 0..8), layout kind (u32: 0 a
  whole tensor, 1 a shard), flags (u32, 0), data offset (u64, 304), data bytes (u64);
* layout, 264 bytes: the global shape and the local shape (8 x i64 each, unused dims -1),
  an axis count (u32, 0..4), a reserved u32, and 4 axes of 32 bytes (kind i32 — 0 DP, 1 TP,
  2 EP, 3 PP, 4 reserved —, axis index, shard rank, shard count, split dim, reserved i32, and
  an i64 holding the shard's extent along its split dim).

A tensor-parallel shard (``put_tensor_with_tp``) is a shard object: its local shape is the
shard's, its global shape the whole tensor's, and one TP axis names its rank, the shard count
and the split dimension.

Nothing here imports torch at module load: kvbridge's Mooncake layer loads without it, and
only the tensor methods need it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Optional

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
LAYOUT_FULL, LAYOUT_SHARD = 0, 1
AXIS_TP = 1
_AXIS_KINDS = range(0, 5)  # DP, TP, EP, PP, reserved

_HEADER = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")
_AXIS_COUNT = struct.Struct("<II")
_AXIS = struct.Struct("<6iq")
HEADER_BYTES = _HEADER.size + 2 * _SHAPE.size + _AXIS_COUNT.size + MAX_AXES * _AXIS.size
assert HEADER_BYTES == 304  # sizeof(TensorMetadata) in Mooncake

# Mooncake's dtype numbers, in order, as torch attribute names, with their element sizes and
# their safetensors names.
DTYPE_NAMES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
               "int64", "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_ELEMENT_BYTES = (4, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 1, 1)
_SAFETENSORS_NAMES = ("F32", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64",
                      "BOOL", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@dataclass
class Meta:
    """A parsed header: what a reader needs to rebuild the tensor."""

    dtype: int  # Mooncake's number, an index into DTYPE_NAMES
    shape: tuple  # the local shape: the tensor (or shard) the object holds
    global_shape: tuple
    layout: int
    axes: list  # (kind, axis_index, rank, count, split_dim, reserved0, extent) per axis
    data_bytes: int


def dtype_number(dtype: Any) -> Optional[int]:
    """Mooncake's number for a torch dtype; None for one Mooncake cannot store (complex, ...)."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.index(name) if name in DTYPE_NAMES else None


def torch_dtype(number: int) -> Any:
    import torch

    return getattr(torch, DTYPE_NAMES[number])


def pack(dtype: int, shape: tuple, data_bytes: int, global_shape: Optional[tuple] = None,
         axes: tuple = ()) -> bytes:
    """The 304-byte header of an object holding ``data_bytes`` of a tensor (a whole one, or a
    shard of a ``global_shape`` tensor along ``axes`` when those are given)."""
    def dims(s: tuple) -> bytes:
        return _SHAPE.pack(*s, *([-1] * (MAX_DIMS - len(s))))

    layout = LAYOUT_SHARD if axes else LAYOUT_FULL
    out = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, dtype, len(shape), layout, 0,
                       HEADER_BYTES, data_bytes)
    out += dims(tuple(global_shape or shape)) + dims(tuple(shape))
    out += _AXIS_COUNT.pack(len(axes), 0)
    for axis in axes:
        out += _AXIS.pack(*axis)
    out += bytes(_AXIS.size * (MAX_AXES - len(axes)))
    return out


def tp_axis(rank: int, count: int, split_dim: int, extent: int) -> tuple:
    """The layout axis of tensor-parallel shard ``rank`` of ``count`` along ``split_dim``."""
    return (AXIS_TP, 0, rank, count, split_dim, 0, extent)


_MANIFEST = struct.Struct(f"<4sHHIIIQI{MAX_DIMS}q")
assert _MANIFEST.size == 96


def manifest(dtype: int, global_shape: tuple, split_dim: int, tp_size: int) -> bytes:
    """The wheel's ``<key>__parallelism_manifest`` object of a TP layout, 96 bytes: ``NAMW``,
    version 1 (u16), size 96 (u16), dtype (u32), ndim (u32), split dim (u32), TP size (u64), a
    reserved u32, and the whole tensor's shape (8 x i64, unused dims -1)."""
    dims = tuple(global_shape) + (-1,) * (MAX_DIMS - len(global_shape))
    return _MANIFEST.pack(b"NAMW", 1, _MANIFEST.size, dtype, len(global_shape), split_dim,
                          tp_size, 0, *dims)


def parse_manifest(data: bytes) -> Optional[tuple]:
    """(dtype, whole shape, split dim, TP size) of a manifest object, or None."""
    if len(data) != _MANIFEST.size:
        return None
    magic, version, size, dtype, ndim, split_dim, tp_size, _r, *dims = _MANIFEST.unpack(data)
    if magic != b"NAMW" or version != 1 or size != _MANIFEST.size or not 0 <= ndim <= MAX_DIMS \
            or not 0 <= split_dim < max(ndim, 1) or tp_size < 1:
        return None
    return dtype, tuple(dims[:ndim]), split_dim, tp_size


def parse(header: bytes, total: int) -> Optional[Meta]:
    """The header of an object (or buffer) of ``total`` bytes, or None when it is not a valid
    tensor object of that size: Mooncake's checks (magic, version, sizes, dtype, dims, axes,
    and data bytes equal to both the shape's and what follows the header)."""
    if total < HEADER_BYTES or len(header) < HEADER_BYTES:
        return None
    (magic, version, header_size, dtype, ndim, layout, _flags, data_offset,
     data_bytes) = _HEADER.unpack_from(header, 0)
    at = _HEADER.size
    global_dims = _SHAPE.unpack_from(header, at)
    local_dims = _SHAPE.unpack_from(header, at + _SHAPE.size)
    at += 2 * _SHAPE.size
    axis_count, _ = _AXIS_COUNT.unpack_from(header, at)
    at += _AXIS_COUNT.size
    if (magic != MAGIC or version != VERSION or header_size != HEADER_BYTES
            or not 0 <= dtype < len(DTYPE_NAMES) or not 0 <= ndim <= MAX_DIMS
            or axis_count > MAX_AXES or layout > LAYOUT_SHARD
            or not HEADER_BYTES <= data_offset <= total or data_bytes != total - data_offset):
        return None
    shape, global_shape = local_dims[:ndim], global_dims[:ndim]
    if any(d < 0 for d in shape + global_shape) or \
            any(d != -1 for d in local_dims[ndim:] + global_dims[ndim:]):
        return None
    numel = 1
    for d in shape:
        numel *= d
    if numel * _ELEMENT_BYTES[dtype] != data_bytes:
        return None
    axes = [_AXIS.unpack_from(header, at + i * _AXIS.size) for i in range(axis_count)]
    for kind, _index, rank, count, split_dim, _r0, _extent in axes:
        if kind not in _AXIS_KINDS or count <= 0 or not 0 <= rank < count or \
                not -1 <= split_dim < ndim:
            return None
    return Meta(dtype, tuple(shape), tuple(global_shape), layout, axes, data_bytes)


# -- safetensors (https://huggingface.co/docs/safetensors: an 8-byte little-endian header
# length, a JSON header {name: {dtype, shape, data_offsets}}, then the tensors' bytes) -------
def safetensors_bytes(name: str, dtype: int, shape: tuple, data: bytes) -> bytes:
    """A safetensors file holding one tensor ``name``. The header is padded with blanks to a
    multiple of 8 bytes, as the format recommends for aligned reads."""
    header = json.dumps({name: {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape),
                                "data_offsets": [0, len(data)]}}, separators=(",", ":"))
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def safetensors_entries(blob: bytes) -> dict:
    """{name: (dtype number, shape, data bytes)} of a safetensors file, in the order of their
    data in the file (safetensors' own loader's order: the "first" tensor is the one whose
    bytes come first). ValueError for a file that is not one, or holds a dtype Mooncake cannot
    store."""
    if len(blob) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", blob, 0)
    if 8 + n > len(blob):
        raise ValueError("the header runs past the end of the file")
    try:
        header = json.loads(blob[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    body = memoryview(blob)[8 + n:]
    found = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_NAMES.index(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r}: unsupported dtype or malformed entry "
                             f"{entry!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= start <= end <= len(body) or end - start != numel * _ELEMENT_BYTES[dtype]:
            raise ValueError(f"tensor {name!r}: data_offsets {start}..{end} do not fit")
        found.append((start, name, (dtype, shape, bytes(body[start:end]))))
    return {name: entry for _, name, entry in sorted(found, key=lambda f: f[0])}
