"""Resident memory of buffers that map files: let the kernel drop pages already read.

A relay or the aggregator reads each received input through a private read-only map of
its spool file (services/wire/spool.py), so every page of it that was read counts in the
process's resident set until the map goes, although the kernel still has it in its page
cache.  A streamed mean reads each input twice, whole (its checksum) and then one range at
a time, so without a hint all of every input would stay resident through the round: n
inputs on top of the node's state.  The whole-input passes (checksum, payload checks)
drop what they read as they go (``drop_read``, ``pieces``), so an input read while the
node also holds a model-sized sum (a relay summing deltas as they arrive) costs a piece
of it, not its size.  ``drop_pages`` tells the kernel (``madvise
MADV_DONTNEED``) that the pages of such a map may go; a later read faults them back from
the page cache, with the same bytes.  It changes no value, only what stays resident.

Only buffers registered here by whoever mapped the file (``register_file_map``) are ever
advised: the same hint on anonymous memory (a bytearray) would zero it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_MADV_DONTNEED = 4  # Linux
_FILE_MAPS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
_madvise: Any = None


def register_file_map(array: np.ndarray) -> None:
    """Mark ``array`` (a private, never written map of a file) as one whose pages may be
    dropped once read (``drop_pages``); forgotten when the array is."""
    _FILE_MAPS[id(array)] = array


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def _advise(buf: object, whole: bool) -> bool:
    """MADV_DONTNEED on the pages of ``buf`` (a memoryview of a registered file map): the
    whole map, or only the pages ``buf`` spans; True if advised."""
    if not isinstance(buf, memoryview):
        return False
    owner = buf.obj
    if not isinstance(owner, np.ndarray) or _FILE_MAPS.get(id(owner)) is not owner:
        return False
    fn = _libc_madvise()
    target: Any = owner if whole else buf
    if not fn or target.nbytes == 0:
        return False
    start = owner.ctypes.data if whole else np.frombuffer(buf, dtype=np.uint8).ctypes.data
    aligned = start - start % mmap.PAGESIZE
    return fn(aligned, target.nbytes + (start - aligned), _MADV_DONTNEED) == 0


def drop_pages(buf: object) -> bool:
    """Let the kernel drop the resident pages of ``buf`` if it is (a view of) a registered
    file map; True if it was advised.  Anything else is left alone."""
    return _advise(buf, whole=True)


#: Bytes a whole-input pass reads before it drops them (``pieces``): the checksum's
#: segment (``CHECKSUM_SEGMENT``).  At 16 MiB a relay's peak, at the commit of a round
#: (the last input validated beside the base and the sum), sat within a few MiB of its
#: 2m + 64 MiB in some part B runs.
PIECE_BYTES = 4 << 20


def drop_read(part: memoryview) -> bool:
    """``drop_pages`` for the pages spanned by ``part`` only (a slice of a registered file
    map; pages it covers in part go too: a later read faults them back).  Safe to call
    from several threads on disjoint parts."""
    return _advise(part, whole=False)


def pieces(buf: Any, offset: int, nbytes: int, size: int = PIECE_BYTES) -> Iterator[int]:
    """The offsets of consecutive ``size``-byte pieces of ``buf[offset : offset + nbytes]``;
    the pages of each piece are dropped (``drop_read``) once the caller asks for the next
    one, and after the last."""
    view = memoryview(buf).cast("B")
    for start in range(offset, offset + nbytes, size):
        yield start
        drop_read(view[start : min(start + size, offset + nbytes)])


#: madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): fault every page of a range in for
#: writing, as a write to each would, without changing a byte.
_MADV_POPULATE_WRITE = 23


def _counts(t: torch.Tensor, holders: int) -> bool:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or t.device.type != "cpu":
        return False
    storage = t.untyped_storage()  # torch's wrapper of t's storage (cached by torch)
    return bool(
        use_count(storage._cdata) == 2  # t's own use, and the wrapper's
        and sys.getrefcount(storage) == 3  # this name, the call's argument, torch's cache
        and sys.getrefcount(t) == holders + 2  # the caller's, this name, the argument
    )


def _calibrated() -> bool:
    """Do the counts ``_counts`` expects hold on this interpreter and torch?  Checked once,
    on a probe: True for it alone, False while another name, a view or its storage's
    wrapper holds it.  (A CPython that counts references differently, as 3.14's borrowed
    references may, or a build without a GIL, fails here, and nothing is ever reused.)"""
    gil = getattr(sys, "_is_gil_enabled", None)
    if gil is not None and not gil():
        return False
    probe = torch.empty(4)
    alone = _counts(probe, 1)
    other = probe
    named = _counts(probe, 1)
    del other
    view = probe[1:]
    viewed = _counts(probe, 1)
    del view
    storage = probe.untyped_storage()
    wrapped = _counts(probe, 1)
    del storage
    return alone and not (named or viewed or wrapped) and _counts(probe, 1)


_COUNTS_HOLD = _calibrated()


def unshared(t: torch.Tensor, holders: int) -> bool:
    """Is ``t`` the one tensor over its memory, held in ``holders`` places (the caller's
    own references to it, not this call's)?  Then no other reference to it, view of it,
    numpy array or memoryview over it, or reference to its storage exists: writing it
    changes nothing that anything else reads.  What no count sees (a raw pointer kept
    without a reference, a weak reference) is out of its reach: nothing here keeps one
    to a tensor it reads.  False wherever the counts are not the ones checked at import
    (``_calibrated``)."""
    return _COUNTS_HOLD and _counts(t, holders + 1)  # + this call's name for it


def populate(t: torch.Tensor) -> bool:
    """Fault in every whole page of ``t``'s memory (a contiguous CPU tensor) for writing,
    changing no byte, so that later writes find them resident; True if done, False where
    the kernel has no MADV_POPULATE_WRITE (nothing changes then: the writes fault as
    before).

    Why: a first write to a page the process has not touched costs a page fault and the
    kernel's zeroing of the page, and on a VM that hands freed memory back to its host
    (virtio-balloon free page reporting, as on this project's test machines) the host's
    backing of it too: measured here, 1.1 s of kernel time for 400 MiB, against 0.03 s to
    write the same pages once resident (``bench/bench_fresh_memory.py``).  Done while a
    node waits between rounds, that cost leaves the next round's critical path.  Safe
    beside readers and writers of the same memory on other threads: it writes nothing."""
    fn = _libc_madvise()
    nbytes = t.numel() * t.element_size()
    if not fn or not t.is_contiguous() or t.device.type != "cpu" or nbytes == 0:
        return False
    start = t.data_ptr()
    first = start - start % mmap.PAGESIZE  # the page holds t's first bytes: t's mapping
    end = start + nbytes
    end -= end % mmap.PAGESIZE  # not past t's mapping (its last partial page is left)
    if end <= first:
        return False
    return bool(fn(first, end - first, _MADV_POPULATE_WRITE) == 0)
