"""Dtype mapping and raw-byte access for torch tensors and numpy arrays.

Saving reads tensor memory in place (no copy) when it is a contiguous CPU tensor, and otherwise
produces contiguous pieces of bounded size, so a non-contiguous or device tensor never needs a
full-size temporary copy. Loading views tensors directly in the file's memory map.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from shardkeep.errors import UnsupportedValueError
from shardkeep.manifest import parse_placements
from shardkeep.tensors.grid import Grid

__all__ = [
    "NUMPY_TO_NAME",
    "TORCH_TO_NAME",
    "array_from_buffer",
    "contiguous_pieces",
    "describe_array",
]

TORCH_TO_NAME: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    # Dtypes that safetensors has no name for: the manifest records these names, and a shard's
    # header carries the same bytes under a dtype it has (tensors.shardfile.CARRIED_DTYPES).
    torch.complex128: "C128",
    torch.complex32: "C32",
}
# More such dtypes, looked up by name: the oldest torch releases the package supports lack some
# (float8_e8m0fnu and float4_e2m1fn_x2 are newer than torch 2.4), and a missing one is not mapped.
for _attribute, _name in (
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float4_e2m1fn_x2", "F4_E2M1FN_X2"),
    ("bits8", "B8"),
    ("bits16", "B16"),
    ("bits1x8", "B1X8"),
    ("bits2x4", "B2X4"),
    ("bits4x2", "B4X2"),
):
    _dtype = getattr(torch, _attribute, None)
    if isinstance(_dtype, torch.dtype):
        TORCH_TO_NAME[_dtype] = _name
del _attribute, _name, _dtype
#: The complex dtype names: a conjugated or negated view has to be resolved before writing.
_COMPLEX = frozenset({"C32", "C64", "C128"})
NAME_TO_TORCH: dict[str, torch.dtype] = {name: dtype for dtype, name in TORCH_TO_NAME.items()}
#: What ``torch.Tensor`` (and subclasses that keep its dispatch, such as ``Parameter``) dispatch with.
_PLAIN_TORCH_DISPATCH = torch.Tensor.__torch_dispatch__

NUMPY_TO_NAME: dict[np.dtype[Any], str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.complex64): "C64",
    np.dtype(np.complex128): "C128",
}
NAME_TO_NUMPY: dict[str, np.dtype[Any]] = {name: dtype for dtype, name in NUMPY_TO_NAME.items()}


def dtensor_type() -> type | None:
    """``DTensor``'s class once ``torch.distributed.tensor`` is imported, else ``None``.

    That package costs about a second to import (it pulls in sympy), and no ``DTensor`` can
    exist before it is imported, so a state without one never pays for it: a plain save or load
    in a fresh process does not import it."""
    # torch.distributed._tensor is where older releases (before 2.5) define it.
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        found = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(found, type):
            return found
    return None


def is_dtensor(value: Any) -> bool:
    """``isinstance(value, DTensor)``, without importing ``torch.distributed.tensor``."""
    kind = dtensor_type()
    return kind is not None and isinstance(value, kind)


def _placement_types() -> tuple[Any, Any, Any]:
    """(Partial, Shard, _StridedShard); only called for a DTensor, so the import is done."""
    from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

    return Partial, Shard, _StridedShard


def compute_local_shape_and_global_offset(shape: Any, mesh: Any, placements: Any) -> tuple[Any, Any]:
    """torch's own helper (the one DCP uses), imported when a DTensor needs it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    return compute(shape, mesh, placements)


def dtensor_chunk(key: str, value: Any) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """For a ``DTensor``: (local tensor, global shape, global offset of the local chunk).

    ``None`` for anything else. ``Partial`` placements (pending reductions) are refused.
    """
    if not is_dtensor(value):
        return None
    Partial, _, _ = _placement_types()
    if any(isinstance(placement, Partial) for placement in value.placements):
        raise UnsupportedValueError(f"DTensor {key!r} has a Partial placement; reduce it (e.g. redistribute) first")
    local_shape, global_offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    local = value.to_local()
    if list(local.shape) != list(local_shape):
        raise UnsupportedValueError(
            f"DTensor {key!r}: local shape {list(local.shape)} differs from its placement's {list(local_shape)}"
        )
    return local, list(value.shape), list(global_offset)


def replica_of(value: Any) -> tuple[int, int]:
    """(this rank's index among the replicas of its chunk, how many replicas there are) for a
    ``DTensor``: ranks that differ only on ``Replicate`` mesh dimensions hold the same chunk."""
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    index, count = 0, 1
    for dim, placement in enumerate(value.placements):
        if placement.is_replicate():
            size = mesh.size(dim)
            index = index * size + (coordinate[dim] if coordinate is not None else 0)
            count *= size
    return index, count


#: A regular layout: (mesh shape, mesh ranks in row-major order, a token naming both, placement names).
Layout = tuple[tuple[int, ...], tuple[int, ...], str, tuple[str, ...]]


@functools.lru_cache(maxsize=64)
def mesh_facts(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(shape, ranks in row-major order of the coordinates, a short token naming both) of a
    device mesh; computed once per mesh."""
    shape = tuple(int(n) for n in mesh.shape)
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    token = hashlib.blake2b(repr((shape, ranks)).encode(), digest_size=8).hexdigest()
    return shape, ranks, token


def regular_layout(key: str, value: Any) -> Layout | None:
    """The layout of a ``DTensor`` whose chunks form the grid
    :class:`~shardkeep.tensors.grid.Grid` computes: placements ``Shard``, ``Replicate`` and
    ``_StridedShard`` (FSDP2 over tensor parallelism), as long as every rank's part is a box
    of the global tensor. ``None`` otherwise: its chunks are listed one by one."""
    _, Shard, _StridedShard = _placement_types()
    names: list[str] = []
    for placement in value.placements:
        if type(placement) is Shard and placement.dim >= 0:
            names.append(f"S{placement.dim}")
        elif isinstance(placement, _StridedShard) and placement.dim >= 0 and isinstance(placement.split_factor, int):
            names.append(f"S{placement.dim}/{placement.split_factor}")
        elif placement.is_replicate():
            names.append("R")
        else:
            return None
    shape, ranks, token = mesh_facts(value.device_mesh)
    dims = parse_placements(names, value.ndim)
    assert dims is not None
    grid = Grid.of(tuple(value.shape), shape, dims)
    if not grid.regular:
        # Some rank's part is not a box (a strided split that does not line up). This rank's
        # may still be one (its chunk is then listed on its own); if it is not, no chunk entry
        # can describe it.
        coordinate = value.device_mesh.get_coordinate()
        if coordinate is not None and not grid.is_box(coordinate):
            raise UnsupportedValueError(
                f"DTensor {key!r}: its placements {list(value.placements)} leave this rank's elements "
                "scattered over the global tensor (not one box); redistribute it to Shard/Replicate "
                "placements before saving"
            )
        return None
    return shape, ranks, token, tuple(names)


def at_mesh_origin(value: Any) -> bool:
    """Whether this rank is at coordinate (0, ..., 0) of a ``DTensor``'s device mesh."""
    coordinate = value.device_mesh.get_coordinate()
    return coordinate is not None and not any(coordinate)


def local_region(value: Any) -> tuple[list[int], list[int]]:
    """(global offset, local shape) of a DTensor's local chunk."""
    local_shape, global_offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return list(global_offset), list(local_shape)


def describe_array(key: str, value: Any) -> tuple[str, list[int], int, int, str, int | None]:
    """Describe a leaf as (dtype name, shape, nbytes, itemsize, array type, address).

    ``address`` is where the bytes already lie contiguously in host memory, or ``None`` when the
    writer must produce contiguous pieces. Raises an error naming ``key`` for anything
    shardkeep does not store. This runs once per tensor on every save, so it keeps to the
    cheapest torch attribute reads.
    """
    if isinstance(value, torch.Tensor):
        kind = type(value)
        if kind is not torch.Tensor and kind.__torch_dispatch__ is not _PLAIN_TORCH_DISPATCH:
            # A FakeTensor or a wrapper subclass reports a data pointer of 0 (or warns): reading
            # its "bytes" in place would crash the process.
            raise UnsupportedValueError(
                f"tensor {key!r} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass with its own "
                "dispatch whose bytes are not in its own memory; save a plain tensor instead"
            )
        name = TORCH_TO_NAME.get(value.dtype)
        if name is None or value.layout != torch.strided or value.is_nested:
            if value.layout != torch.strided or value.is_nested:
                layout = "nested" if value.is_nested else value.layout
                raise UnsupportedValueError(
                    f"tensor {key!r} has layout {layout}; only dense (strided) tensors are supported"
                )
            if value.is_quantized:
                raise UnsupportedValueError(f"tensor {key!r} is quantized; dequantize it before saving")
            raise UnsupportedValueError(
                f"tensor {key!r} has dtype {value.dtype}, which shardkeep does not store (docs/manifest.md, dtypes)"
            )
        address: int | None = None
        try:
            if value.is_cpu:
                if value.is_contiguous() and (name not in _COMPLEX or not (value.is_conj() or value.is_neg())):
                    address = value.data_ptr()
            elif value.is_meta:
                raise UnsupportedValueError(f"tensor {key!r} is on the meta device and has no data")
            return name, list(value.shape), value.nbytes, value.itemsize, "torch", address
        except RuntimeError as exc:  # a tensor without storage (inside torch.func transforms ...)
            raise UnsupportedValueError(f"tensor {key!r} cannot be read as a dense tensor: {exc}") from exc
    if isinstance(value, np.ndarray):
        np_name = NUMPY_TO_NAME.get(value.dtype.newbyteorder("=")) if value.dtype.byteorder in "=|<" else None
        if np_name is None:
            raise UnsupportedValueError(f"array {key!r} has dtype {value.dtype}, which safetensors cannot store")
        array_address = data_address(value) if value.flags.c_contiguous else None
        return np_name, list(value.shape), int(value.nbytes), int(value.itemsize), "numpy", array_address
    raise UnsupportedValueError(f"value at {key!r} of type {type(value).__name__} is not a tensor")


def contiguous_pieces(value: Any, max_bytes: int) -> Iterator[Any]:
    """Contiguous CPU pieces that together hold ``value``'s bytes in C order.

    A contiguous CPU tensor or array is yielded as itself (no copy). Anything else is copied
    in pieces of at most ``max_bytes`` (or one row of the innermost dimension, if larger), so the
    memory held at once stays bounded.
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():
            tensor = tensor.resolve_neg()
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            yield tensor
            return
        # Copied as integers of the same width: only the bytes matter, and the bits*, float4 and
        # float8_e8m0 dtypes lack kernels (under torch.use_deterministic_algorithms even the
        # empty tensor a copy makes cannot be filled).
        same_width = _SAME_WIDTH_INTEGER.get(tensor.element_size())
        yield from _torch_pieces(tensor.view(same_width) if same_width is not None else tensor, max_bytes)
        return
    array = value
    if array.flags.c_contiguous:
        yield array
        return
    yield from _numpy_pieces(array, max_bytes)


_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _torch_pieces(tensor: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= max_bytes or tensor.dim() == 0:
        yield tensor.to("cpu").contiguous()
        return
    row_bytes = nbytes // tensor.shape[0]
    if row_bytes <= max_bytes or tensor.dim() == 1:
        rows = max(1, max_bytes // max(row_bytes, 1))
        for start in range(0, tensor.shape[0], rows):
            yield tensor[start : start + rows].to("cpu").contiguous()
    else:
        for index in range(tensor.shape[0]):
            yield from _torch_pieces(tensor[index], max_bytes)


def _numpy_pieces(array: np.ndarray, max_bytes: int) -> Iterator[np.ndarray]:
    if array.nbytes <= max_bytes or array.ndim == 0:
        yield np.ascontiguousarray(array)
        return
    row_bytes = array.nbytes // array.shape[0]
    if row_bytes <= max_bytes or array.ndim == 1:
        rows = max(1, max_bytes // max(row_bytes, 1))
        for start in range(0, array.shape[0], rows):
            yield np.ascontiguousarray(array[start : start + rows])
    else:
        for index in range(array.shape[0]):
            yield from _numpy_pieces(array[index], max_bytes)


def data_address(piece: Any) -> int:
    """The address of a contiguous CPU piece's first byte."""
    if isinstance(piece, torch.Tensor):
        return int(piece.data_ptr())
    return int(piece.__array_interface__["data"][0])


def piece_nbytes(piece: Any) -> int:
    if isinstance(piece, torch.Tensor):
        return piece.numel() * piece.element_size()
    return int(piece.nbytes)


def byte_view(piece: Any) -> memoryview:
    """A zero-copy byte view of a contiguous CPU piece. The caller keeps ``piece`` alive."""
    nbytes = piece_nbytes(piece)
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(data_address(piece))).cast("B")


def array_from_buffer(
    buffer: memoryview, dtype_name: str, shape: list[int], offset: int, nbytes: int, array_type: str, key: str
) -> Any:
    """A tensor or array viewing ``buffer[offset:offset+nbytes]`` without copying when aligned."""
    if array_type == "numpy":
        np_dtype = NAME_TO_NUMPY.get(dtype_name)
        if np_dtype is None:
            raise UnsupportedValueError(f"{key!r}: dtype {dtype_name} cannot be loaded as a numpy array")
        count = nbytes // np_dtype.itemsize if np_dtype.itemsize else 0
        return np.frombuffer(buffer, dtype=np_dtype, count=count, offset=offset).reshape(shape)
    dtype = NAME_TO_TORCH.get(dtype_name)
    if dtype is None:
        raise UnsupportedValueError(f"{key!r}: dtype {dtype_name} is not supported by this torch")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = dtype.itemsize
    if offset % itemsize:
        # Unaligned (a shard written by another tool): copy into an aligned tensor.
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset).clone()
        return raw.view(dtype).reshape(shape)
    flat = torch.frombuffer(buffer, dtype=dtype, count=nbytes // itemsize, offset=offset)
    if len(shape) == 1:
        return flat
    return flat.view(*shape) if shape else flat.view(())
