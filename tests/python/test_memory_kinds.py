"""Registration checks by memory kind as Python sees them (docs/transfer-engine.md, "GPU
memory"): memory that is not what its kind says raises errors.UnknownMemoryError, a ValueError
naming what was found. The CUDA cases run in C++ against a fake driver (tests/gpu)."""

from __future__ import annotations

import ctypes
import mmap

import pytest

import kvbridge
from kvbridge import errors

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def engine():
    return kvbridge.TransferEngine(node_id="py-kinds", listen="127.0.0.1:0")


def test_unmapped_host_range_raises_unknown_memory():
    page = mmap.PAGESIZE
    addr = _libc.mmap(None, 3 * page, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        assert _libc.munmap(addr + page, page) == 0  # a hole in the middle
        with engine() as eng:
            with pytest.raises(errors.UnknownMemoryError, match="not mapped host memory") as e:
                eng.register((addr, 3 * page))
            assert isinstance(e.value, ValueError)
            assert e.value.name == "UNKNOWN_MEMORY" and e.value.code == 21
            eng.register((addr, page))  # the mapped first page alone is fine
    finally:
        _libc.munmap(addr, page)
        _libc.munmap(addr + 2 * page, page)


def test_unknown_memory_is_in_every_table():
    assert errors.StatusCode.UNKNOWN_MEMORY == 21
    assert kvbridge._C.STATUS_CODES["UNKNOWN_MEMORY"] == 21
    assert type(errors.from_status(21, "UNKNOWN_MEMORY", "x")) is errors.UnknownMemoryError

