"""moka's device memory from torch's caching allocator (``allocator="torch"``, the default of CUDA
layers): the scratch of each call and what a forward saves for its backward then share torch's
cache with the rest of the model and count in ``torch.cuda.memory_allocated()``, its peak and its
memory snapshots."""
from __future__ import annotations

import sys
import threading

import torch

from . import _moka

ALLOCATORS = ("torch", "moka")  # moka.torch's choices: torch's caching allocator, moka's pool

# What torch.cuda.caching_allocator_alloc calls, on the current device: a request on the current
# device (all in practice: moka's calls run with their tensors' device current) skips the public
# function's device switch around it, paid on every allocation of every layer call.
_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


class TorchMemory:
    """alloc and free of a ``moka._moka.PythonAllocator`` on one device over torch's caching allocator.

    torch gives a block back to the stream it was allocated on, while moka frees memory on the
    stream of its last use (a backward on another stream than its forward frees what the forward
    saved there). Where the two differ, the allocation stream waits for the last use before the
    block goes back, so that its next user on that stream cannot overwrite it early."""

    def __init__(self, device: int):
        self.device = device
        self._streams: dict[int, int] = {}  # pointer -> the stream it was allocated on
        self._lock = threading.Lock()  # layers on several threads share one device's allocator

    def alloc(self, nbytes: int, stream: int) -> int:
        if _raw_alloc is not None and _current_device is not None and _current_device() == self.device:
            pointer = _raw_alloc(nbytes, stream)
        else:
            pointer = torch.cuda.caching_allocator_alloc(nbytes, self.device, stream)
        with self._lock:
            self._streams[pointer] = stream
        return pointer

    def free(self, pointer: int, nbytes: int, stream: int) -> None:
        if sys.is_finalizing():  # torch may be half torn down; the process's memory goes with it
            return
        with self._lock:
            allocated_on = self._streams.pop(pointer)
        if stream != allocated_on:
            last_use = torch.cuda.Event()
            last_use.record(self._stream(stream))
            self._stream(allocated_on).wait_event(last_use)
        torch.cuda.caching_allocator_delete(pointer)

    def _stream(self, handle: int) -> torch.cuda.Stream:
        if handle == 0:  # the legacy default stream, torch's default
            return torch.cuda.default_stream(self.device)
        return torch.cuda.ExternalStream(handle, device=self.device)

    def live_blocks(self) -> int:
        """How many blocks moka holds now (for tests)."""
        with self._lock:
            return len(self._streams)


_torch_allocators: dict[int, _moka.PythonAllocator] = {}
_torch_allocators_lock = threading.Lock()


def torch_allocator(device: int) -> _moka.PythonAllocator:
    """The allocator over torch's caching allocator of CUDA device ``device``, shared by every layer there."""
    with _torch_allocators_lock:
        allocator = _torch_allocators.get(device)
        if allocator is None:
            memory = TorchMemory(device)
            allocator = _torch_allocators[device] = _moka.PythonAllocator(memory.alloc, memory.free)
        return allocator
