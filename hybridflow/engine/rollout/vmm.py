"""Device memory that keeps its address when it is given back: CUDA virtual memory management.

The rollout engine's CUDA graphs hold raw pointers into the KV cache. A cache freed with the caching
allocator and allocated again lands somewhere else, so every `sleep`/`wake` cycle of the hybrid engine
had to capture all graphs again (about half a second a step at the 0.5B shape). `StableBuffer` reserves
a virtual address range once and maps physical memory into it only while the engine is awake: `unmap()`
hands the physical memory back to the driver (other allocators, e.g. the trainer's, can use it) and
`map()` backs the same addresses with fresh memory, so the captured graphs stay valid.

It talks to the CUDA driver (`libcuda`) through ctypes: cuMemAddressReserve / cuMemCreate / cuMemMap /
cuMemSetAccess, and cuMemUnmap / cuMemRelease to give the memory back. `StableBuffer.supported(device)`
is False wherever that is unavailable (no CUDA, no driver library, or a device without virtual memory
management); the engine then falls back to ordinary tensors and re-captures on `wake`.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

_PINNED, _ON_DEVICE, _READ_WRITE, _VMM_ATTRIBUTE = 1, 1, 3, 102  # CUDA driver enum values


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _require_driver() -> ctypes.CDLL:
    driver = _driver()
    if driver is None:
        raise RuntimeError("CUDA virtual memory management needs the driver library libcuda.so.1, which did not "
                           "load; check StableBuffer.supported(device) before making a StableBuffer")
    return driver


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver call {call} failed with CUresult {result}")


class StableBuffer:
    """`nbytes` of device memory at a fixed address; `tensor` views it (uint8) while it is mapped."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._lib = _require_driver()
        torch.cuda.init()  # the runtime makes the device's primary context current for the driver calls
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._prop = _AllocationProp(type=_PINNED, location=_Location(type=_ON_DEVICE, id=index))
        granularity = ctypes.c_size_t()
        _check(self._lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop), 0),
               "cuMemGetAllocationGranularity")
        self.nbytes = -(-nbytes // granularity.value) * granularity.value
        self._access = _AccessDesc(location=_Location(type=_ON_DEVICE, id=index), flags=_READ_WRITE)
        self.address = ctypes.c_uint64()
        with torch.cuda.device(index):
            _check(self._lib.cuMemAddressReserve(ctypes.byref(self.address), ctypes.c_size_t(self.nbytes),
                                                 ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)),
                   "cuMemAddressReserve")
        self._handle: ctypes.c_uint64 | None = None
        self.map()
        self.tensor = torch.as_tensor(_ArrayView(self.address.value, self.nbytes), device=self.device)

    @staticmethod
    def supported(device: torch.device) -> bool:
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        driver = _driver()
        if driver is None:
            return False
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        value = ctypes.c_int()
        if driver.cuDeviceGetAttribute(ctypes.byref(value), _VMM_ATTRIBUTE, index) != 0:
            return False
        return value.value == 1

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the reserved addresses with new physical memory (its contents are undefined)."""
        if self.mapped:
            return
        handle = ctypes.c_uint64()
        _check(self._lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(self._prop),
                                     ctypes.c_uint64(0)), "cuMemCreate")
        try:
            _check(self._lib.cuMemMap(self.address, ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0), handle,
                                      ctypes.c_uint64(0)), "cuMemMap")
            _check(self._lib.cuMemSetAccess(self.address, ctypes.c_size_t(self.nbytes), ctypes.byref(self._access),
                                            ctypes.c_size_t(1)), "cuMemSetAccess")
        except RuntimeError:
            self._lib.cuMemRelease(handle)
            raise
        self._handle = handle

    def unmap(self) -> None:
        """Give the physical memory back to the driver; the addresses stay reserved for `map()`."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)  # no kernel may still be reading the cache
        _check(self._lib.cuMemUnmap(self.address, ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(self._lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def __del__(self) -> None:
        if getattr(self, "address", None) is None:
            return
        try:
            self.unmap()
            self._lib.cuMemAddressFree(self.address, ctypes.c_size_t(self.nbytes))
        except Exception:  # interpreter shutdown: the driver or torch may already be gone
            pass


class _ArrayView:
    """The `__cuda_array_interface__` through which torch wraps the mapped range without copying."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}
