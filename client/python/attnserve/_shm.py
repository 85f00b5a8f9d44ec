"""Shared memory for clients on the server's host (the server runs with --allow-shared-memory): numpy
arrays backed by a POSIX shared memory region the server reads requests' tensors from and writes answers
into, so their bytes never cross the socket."""
import mmap
import os
import threading
import weakref

import numpy as np

from .v1 import attention_pb2 as pb

_live = weakref.WeakSet()  # Regions registered with some server, to find an array's region.
_lock = threading.Lock()


class SharedMemoryRegion:
    """A POSIX shared memory object made here and registered with the server under `name` (Client.
    shared_memory makes one). `array(shape, dtype, offset)` gives a numpy array backed by it: such an array
    given to attend() (query, key, value, masks, or `out=`) travels as a reference to its bytes. Use it with
    `with`, or close() it: that unregisters it and unlinks the object."""

    def __init__(self, client, name, byte_size):
        self.name = name
        # The object shm_open(key) opens: on Linux a file under /dev/shm.
        self.key = f"/attnserve-{os.getpid()}-{name}"
        self._path = "/dev/shm" + self.key
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, byte_size)
            self._map = mmap.mmap(fd, byte_size)
        except Exception:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self.byte_size = byte_size
        self._client = client
        self._address = np.frombuffer(self._map, dtype=np.uint8, count=1).ctypes.data
        try:
            client.register_shared_memory(name, self.key, 0, byte_size)
        except Exception:
            self._unlink()
            raise
        with _lock:
            _live.add(self)

    def array(self, shape, dtype, offset=0):
        """A numpy array of `shape` and `dtype` (numpy's, or ml_dtypes.bfloat16) at `offset` of the region."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape)) if len(shape) else 1
        if offset < 0 or offset + count * dt.itemsize > self.byte_size:
            raise ValueError(f"shared memory {self.name}: {count * dt.itemsize} bytes at offset {offset} do not "
                             f"fit its {self.byte_size}")
        return np.frombuffer(self._map, dtype=dt, count=count, offset=offset).reshape(shape)

    def ref_of(self, a):
        """A SharedMemoryRef to array `a`'s bytes when they lie in this region (C-contiguous), else None."""
        start = a.__array_interface__["data"][0]
        if not a.flags["C_CONTIGUOUS"] or not (self._address <= start < self._address + self.byte_size):
            return None
        if start + a.nbytes > self._address + self.byte_size:
            return None
        return pb.SharedMemoryRef(region=self.name, offset=start - self._address, byte_size=a.nbytes)

    def close(self):
        """Unregisters it (requests using it finish with it) and unlinks the object."""
        with _lock:
            _live.discard(self)
        try:
            self._client.unregister_shared_memory(self.name)
        finally:
            self._unlink()

    def _unlink(self):
        os.unlink(self._path)
        try:
            self._map.close()
        except BufferError:
            pass  # Arrays of it are still alive: the mapping goes with the last of them.

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def ref_of(a):
    """The reference to numpy array `a`'s bytes in a registered region, or None (it travels as bytes)."""
    if not isinstance(a, np.ndarray):
        return None
    with _lock:
        regions = list(_live)
    for r in regions:
        ref = r.ref_of(a)
        if ref is not None:
            return ref
    return None
