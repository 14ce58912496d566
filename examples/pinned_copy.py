"""The pinned-copy floor of examples/bench_prefill.py: on this process's GPU,
N bytes from GPU memory into pinned host memory and N bytes from pinned host
memory into GPU memory at once (two streams), what a bulk collective through
host memory cannot beat (the GB10 path: host inboxes).

Through the CUDA driver API (libcuda.so.1, which every NVIDIA driver
installs) with ctypes, so that it measures the copies alone: no XLA, no
jax_arx. It uses the primary context of device 0, the one jax uses: run it
in a process that sees one GPU (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import ctypes

_u64, _size, _ptr, _uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint

# name: argument types; every function returns a CUresult (0: success).
_SIGNATURES = {
    "cuInit": [_uint],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_ptr), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxSetCurrent": [_ptr],
    "cuMemAlloc_v2": [ctypes.POINTER(_u64), _size],
    "cuMemFree_v2": [_u64],
    "cuMemAllocHost_v2": [ctypes.POINTER(_ptr), _size],
    "cuMemFreeHost": [_ptr],
    "cuStreamCreate": [ctypes.POINTER(_ptr), _uint],
    "cuStreamDestroy_v2": [_ptr],
    "cuEventCreate": [ctypes.POINTER(_ptr), _uint],
    "cuEventDestroy_v2": [_ptr],
    "cuEventRecord": [_ptr, _ptr],
    "cuEventSynchronize": [_ptr],
    "cuStreamWaitEvent": [_ptr, _ptr, _uint],
    "cuMemcpyDtoHAsync_v2": [_ptr, _u64, _size, _ptr],
    "cuMemcpyHtoDAsync_v2": [_u64, _ptr, _size, _ptr],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2


class PinnedCopy:
    """Buffers and streams for one size; ``run()`` starts one copy each way
    and returns at once, ``wait()`` waits for the last run. ``close()``
    frees everything (also on exit from a ``with`` block)."""

    def __init__(self, nbytes: int):
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"pinned-copy floor: cannot load the CUDA driver (libcuda.so.1): {e}") from e
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self._cu, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self.nbytes = int(nbytes)
        self._freed = []  # (function name, handle) in the order to free
        self._call("cuInit", 0)
        self._device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(self._device), 0)
        ctx = _ptr()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self._device.value)
        self._context_retained = True
        self._call("cuCtxSetCurrent", ctx)
        self._src_dev, self._dst_dev = self._alloc_device(), self._alloc_device()
        self._src_host, self._dst_host = self._alloc_host(), self._alloc_host()
        self._d2h, self._h2d = self._stream(), self._stream()
        self._start, self._h2d_done, self._done = (self._event() for _ in range(3))

    def run(self):
        """One copy each way, both started together; the `done` event
        follows both."""
        self._call("cuEventRecord", self._start, self._d2h)
        self._call("cuStreamWaitEvent", self._h2d, self._start, 0)
        self._call("cuMemcpyDtoHAsync_v2", self._dst_host, self._src_dev.value, self.nbytes, self._d2h)
        self._call("cuMemcpyHtoDAsync_v2", self._dst_dev.value, self._src_host, self.nbytes, self._h2d)
        self._call("cuEventRecord", self._h2d_done, self._h2d)
        self._call("cuStreamWaitEvent", self._d2h, self._h2d_done, 0)
        self._call("cuEventRecord", self._done, self._d2h)

    def wait(self):
        self._call("cuEventSynchronize", self._done)

    def close(self):
        while self._freed:
            name, handle = self._freed.pop()
            getattr(self._cu, name)(handle)  # best effort: nothing to do about a failure here
        if getattr(self, "_context_retained", False):
            self._cu.cuDevicePrimaryCtxRelease_v2(self._device.value)
            self._context_retained = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _alloc_device(self):
        p = _u64()
        self._call("cuMemAlloc_v2", ctypes.byref(p), self.nbytes)
        self._freed.append(("cuMemFree_v2", p.value))
        return p

    def _alloc_host(self):
        p = _ptr()
        self._call("cuMemAllocHost_v2", ctypes.byref(p), self.nbytes)
        self._freed.append(("cuMemFreeHost", p))
        return p

    def _stream(self):
        s = _ptr()
        self._call("cuStreamCreate", ctypes.byref(s), _STREAM_NON_BLOCKING)
        self._freed.append(("cuStreamDestroy_v2", s))
        return s

    def _event(self):
        e = _ptr()
        self._call("cuEventCreate", ctypes.byref(e), _EVENT_DISABLE_TIMING)
        self._freed.append(("cuEventDestroy_v2", e))
        return e

    def _call(self, name, *args):
        status = getattr(self._cu, name)(*args)
        if status != 0:
            text = ctypes.c_char_p()
            self._cu.cuGetErrorName(status, ctypes.byref(text))
            what = text.value.decode() if text.value else f"CUresult {status}"
            self.close()
            raise RuntimeError(f"pinned-copy floor: {name} failed with {what} ({self.nbytes} bytes each way)")
