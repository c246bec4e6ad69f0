"""Turns what users pass as memory into (address, length) pairs.

Accepted everywhere a buffer is expected:
  * a torch.Tensor, contiguous, on the CPU or a CUDA device (its bytes: numel * element_size);
  * any object exporting the buffer protocol, C-contiguous (bytearray, memoryview, numpy
    arrays, mmap, ...); read-only objects (bytes) only where kvbridge reads the memory;
  * a raw ``(address, length)`` pair of ints (host memory);
  * a ``Region`` (address, length, kind, device): memory already described, e.g. a range of
    device memory inside a CUDA tensor, or a raw pointer of either kind (DETECT) to register.

The caller keeps the object alive (and does not resize it) while kvbridge uses the memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple, Union

from kvbridge._native import _C
from kvbridge.errors import InvalidArgumentError

# What a buffer argument may be (see the module docstring).
BufferLike = Union[Any, Tuple[int, int]]

HOST = 1
CUDA = 2
DETECT = 3  # registration only: what the memory is (CUDA device memory the driver knows, or host)


@dataclass(frozen=True)
class Region:
    address: int
    length: int
    kind: int = HOST  # HOST, CUDA, or DETECT (registration only)
    device: int = -1  # CUDA device index for CUDA memory


def _is_tensor(obj: Any) -> bool:
    # No torch import here: kvbridge works without torch installed.
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def region(obj: BufferLike, *, writable: bool, what: str = "buffer") -> Region:
    """The memory `obj` denotes; InvalidArgumentError naming `what` if it is not usable."""
    if isinstance(obj, Region):
        if obj.address <= 0 or obj.length < 0 or obj.kind not in (HOST, CUDA, DETECT) or (
                obj.kind == CUDA and obj.device < 0):
            raise InvalidArgumentError(f"{what}: {obj} is not a valid range")
        return obj
    if _is_tensor(obj):
        if not obj.is_contiguous():
            raise InvalidArgumentError(
                f"{what}: tensor of shape {tuple(obj.shape)} is not contiguous "
                "(call .contiguous() first)")
        length = obj.numel() * obj.element_size()
        if obj.is_cuda:
            return Region(obj.data_ptr(), length, CUDA, obj.device.index or 0)
        if obj.device.type != "cpu":
            raise InvalidArgumentError(f"{what}: tensors on {obj.device} are not supported")
        return Region(obj.data_ptr(), length)
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        address, length = obj
        if address <= 0 or length < 0:
            raise InvalidArgumentError(
                f"{what}: (address, length) = ({address:#x}, {length}) is not a valid range")
        return Region(address, length)
    try:
        address, length, _readonly = _C.buffer_address(obj, writable)
    except BufferError as e:
        raise InvalidArgumentError(
            f"{what}: {type(obj).__name__} cannot be used as memory: {e}") from e
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: expected a torch.Tensor, an object with the buffer protocol or an "
            f"(address, length) pair, got {type(obj).__name__}") from None
    return Region(address, length)


def regions(obj: Any, *, writable: bool, what: str) -> list[Region]:
    """One key's buffers: a single buffer or a list of them (e.g. K and V of a page)."""
    if isinstance(obj, list):
        return [region(b, writable=writable, what=f"{what}[{i}]") for i, b in enumerate(obj)]
    return [region(obj, writable=writable, what=what)]


def host_bytes_of(tensor: Any) -> Any:
    """A contiguous CPU uint8 copy of a CUDA tensor's bytes."""
    return tensor.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu()


def copy_host_to_tensor(host: bytearray, n: int, tensor: Any) -> None:
    """Copies the first n bytes of host into a contiguous (CUDA) tensor's bytes."""
    torch = __import__("torch")
    src = torch.frombuffer(host, dtype=torch.uint8, count=n) if n else None
    if src is not None:
        tensor.view(-1).view(torch.uint8)[:n].copy_(src)
