"""The receive side's workers: hash, copy and spool chunks off the gRPC thread.

``Sink`` owns what one delta transfer builds: its incremental content hash
(``digest.content_hasher``) and either a preallocated buffer or, when spooling, a temp
file. The gRPC handler thread only pulls chunks and hands them to one worker per job
(hash; copy or write) through bounded queues, so the network, the hash (BLAKE3 drops the
GIL for large buffers), the copy (``copy_into``, off the GIL) and the file write run
side by side instead of adding up.

Where the time goes (bench/bench_transport.py, 256 MiB, 2 cores): the hash alone was
~0.17 s with sha256 (digest format 1; BLAKE3 takes about a quarter) and bare gRPC
streaming ~0.15-0.2 s of both cores; writing into fresh page cache or touching a fresh
buffer costs 0.07-0.9 s of kernel time on this VM depending on whether the host must
back the pages again. A spooled transfer therefore writes the file only (no second copy
in anonymous memory) and maps the file's page cache as its ``data`` afterwards.

Durability: while writing, the sink asks the kernel to start writeback every
``WRITEBACK_BYTES`` (``sync_file_range``, Linux; a no-op elsewhere), so the final
``fsync`` in ``commit`` waits for the tail only, not for the whole payload.  A node's
intake lets that fsync run on a thread of its own (``commit(wait=False)``) while the node
decodes the delta and, when it completes a round, computes the merge: the fsync is
disk-bound and that work is CPU-bound.  ``durable`` joins it before the file is published,
so no tape entry names a delta whose bytes are not on disk.

Warm files (``prepare``): between rounds a node makes the spool files of the next
round's transfers ready, sparse files of the sizes its last round's took whose page cache
is already there (``MADV_POPULATE_READ`` of the holes: clean zero pages, nothing written
to disk), and a transfer's ``Sink`` writes into one of them (the tail cut at ``commit``
where the transfer is shorter).  Writing into fresh page cache costs the kernel the
pages' allocation and, on a VM that hands freed memory back to its host (virtio-balloon
free page reporting, as on this project's test machines), the host's backing of them:
measured here, 0.6-0.9 s of CPU for 400 MiB against 0.08 s into pages already cached
(``bench/bench_fresh_memory.py``), inside the round; the warm-up pays it while the
islands train.  A warm file is an ``.incoming-*.part`` like any other (``remove_stale``
removes those a crash left).

Files on disk: ``<spool_dir>/.incoming-*.part`` while a transfer is in flight;
``publish_file`` turns one into ``<dest_dir>/<digest>`` with a hard link (atomic,
never replaces an existing file) and removes the temp name, then fsyncs ``dest_dir``.
``spool_dir`` and ``dest_dir`` must be on the same filesystem.

Invariants: memory is the buffer (or the file's page cache) plus at most ``DEPTH``
chunks per queue; a sink that fails or is aborted removes its temp file; a worker never
blocks the handler forever (after an error it keeps draining its queue until stopped).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from hypertrain.common.codec import survey
from hypertrain.common.digest import content_hasher
from hypertrain.common.pages import register_file_map
from hypertrain.common.trust.keys import fsync_dir, write_all
from hypertrain.wire.errors import WireError
from hypertrain.wire.frames import Data

#: Start writeback of the spool file every this many bytes.
WRITEBACK_BYTES = 16 << 20
#: Chunks that may wait in each worker's queue.  Each transfer keeps up to this many
#: per worker alive, so it multiplies with the concurrent pushes a node receives: with 4
#: concurrent 120 MiB pushes a relay's transfer memory peaked 137-155 MiB above idle at
#: 8, and 62 MiB at 2, with the same push time; bench_transport.py's push and merge
#: figures did not move either (0.29-0.31 of TCP in memory, either way).
DEPTH = 2
#: Run hashing / copying / writing on worker threads (False: inline in the handler
#: thread; only the benchmark turns it off, to measure what the overlap buys).
OVERLAP = True
_SYNC_FILE_RANGE_WRITE = 2


#: A temp file's name in a spool folder: ``<prefix><random><suffix>`` (``new_temp``); what
#: ``remove_stale`` removes at start-up.
TEMP_PREFIX, TEMP_SUFFIX = ".incoming-", ".part"


def new_temp(folder: Path) -> tuple[int, str]:
    """A new, empty temp file in ``folder``: (descriptor, path)."""
    return tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX)


def _load_sync_file_range() -> Any:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing [offset, offset + length) to disk; never blocks on it."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def copy_into(dest: memoryview, offset: int, data: Data) -> None:
    """``dest[offset : offset + len(data)] = data`` without holding the GIL.

    A slice assignment copies under the GIL, and so do the page faults of a freshly
    allocated destination (measured: ~0.15 s per 256 MiB on this VM), stalling the
    gRPC thread that pulls the next chunk.  ``ctypes.memmove`` releases the GIL.
    """
    n = len(data)
    if offset < 0 or offset + n > dest.nbytes:
        raise ValueError(f"copy of {n} bytes at {offset} overflows a buffer of {dest.nbytes}")
    if n:
        target = np.frombuffer(dest, dtype=np.uint8).ctypes.data
        source = np.frombuffer(data, dtype=np.uint8).ctypes.data
        ctypes.memmove(target + offset, source, n)


def failure(error: BaseException) -> WireError:
    """The status a transfer ends with when a local worker failed (disk full, ...)."""
    return WireError(grpc.StatusCode.INTERNAL, f"receiver failed to store the transfer: {error}")


class Worker:
    """One thread fed through a bounded queue: ``fn(offset, data)`` per chunk, in order.

    ``put`` blocks while ``depth`` chunks wait (backpressure on the gRPC handler) and
    raises ``error`` once ``fn`` failed; ``stop`` waits for the queued chunks.
    """

    def __init__(self, name: str, fn: Callable[[int, Data], None], depth: int) -> None:
        self.fn = fn
        self.error: BaseException | None = None
        self.queue: queue.Queue[tuple[int, Data] | None] = queue.Queue(depth)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # keep draining so that put() never blocks forever
            try:
                self.fn(*item)
            except BaseException as exc:  # reported to the handler by put/finish
                self.error = exc

    def put(self, offset: int, data: Data) -> None:
        if self.error is not None:
            raise failure(self.error)
        self.queue.put((offset, data))

    def stop(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()


class Sink:
    """Hashes chunks in order and stores them in ``buffer`` or a spool file, on workers.

    Without ``spool_dir`` the chunks are copied into a preallocated buffer (allocated
    uninitialized: its pages are first touched by the copy worker, not up front).
    With ``spool_dir`` they are written to a temp file only; after ``commit``,
    ``buffer`` is a private memory map of that file (its pages are the page cache the
    write just filled: no second copy of the payload in memory; the file's descriptor
    stays open only until its fsync is done, ``durable``).
    """

    def __init__(self, size: int, spool_dir: Path | None, *, depth: int = DEPTH) -> None:
        self.size = size
        self.path: Path | None = None
        self.buffer: memoryview = memoryview(b"")
        self._hash = content_hasher()
        self._fd = -1
        self._written = 0
        self._synced = 0
        self._error: BaseException | None = None
        self._syncer: threading.Thread | None = None
        self._sync_error: OSError | None = None
        self._capacity = 0  # bytes of a warm file taken (its tail is cut at commit)
        # A spooled delta's checksum segments and value checks, computed beside its hash
        # while each chunk is in cache (codec/survey.py): the node's checks of the mapped
        # file take them instead of reading it again.
        self._survey = survey.Survey(size) if spool_dir is not None else None
        stages = [("wire-hash", self._hash_chunk)]
        if spool_dir is not None:
            warm = take_warm(spool_dir, size) if size else None
            if warm is not None:
                fd, name, self._capacity = warm
            else:
                try:
                    fd, name = new_temp(spool_dir)
                except OSError as exc:
                    raise WireError(
                        grpc.StatusCode.INTERNAL, f"cannot spool to {spool_dir}: {exc}"
                    ) from exc
            self._fd, self.path = fd, Path(name)
            stages.append(("wire-spool", self._write_chunk))
        elif size:
            self.buffer = torch.empty(size, dtype=torch.uint8).numpy().data
            stages.append(("wire-copy", self._copy_chunk))
        self._stages = [Worker(name, fn, depth) for name, fn in stages] if OVERLAP else []
        self._inline = [] if OVERLAP else [fn for _, fn in stages]

    def put(self, offset: int, data: Data) -> None:
        """Queue one chunk; blocks while ``depth`` chunks wait (the handler's backpressure)."""
        for fn in self._inline:
            try:
                fn(offset, data)
            except OSError as exc:
                raise failure(exc) from exc
        for stage in self._stages:
            stage.put(offset, data)

    def finish(self) -> str:
        """Wait for every queued chunk; the content digest (hex) of everything put, in order."""
        self._stop()
        if self._error is not None:
            raise failure(self._error)
        return self._hash.hexdigest()

    def commit(self, wait: bool = True) -> None:
        """Map the temp file as ``buffer`` and fsync it (after ``finish``); it stays at
        ``path``.  ``wait=False``: the fsync runs on a thread of its own while the caller
        reads ``buffer`` (the bytes are in the page cache already), and ``durable`` waits
        for it; nothing may refer to the file as durable before that."""
        if self._fd < 0:
            return
        try:
            if self._capacity > self.size:  # a warm file: its bytes past the transfer go
                os.ftruncate(self._fd, self.size)
            if self.size and self.path is not None:
                # A private map (copy-on-write: writes never reach the file) that keeps
                # no file descriptor open, unlike mmap.mmap on Python < 3.13.
                mapped = torch.from_file(
                    str(self.path), shared=False, size=self.size, dtype=torch.uint8
                )
                array = mapped.numpy()
                register_file_map(array)  # its pages may be dropped once read
                array.flags.writeable = False  # a received delta is read, never written
                if self._survey is not None:
                    survey.register(array, self._survey.facts())
                self.buffer = array.data
        except (OSError, RuntimeError) as exc:
            self.abort()
            raise WireError(grpc.StatusCode.INTERNAL, f"spool map failed: {exc}") from exc
        if wait:
            self._fsync()
            self.durable()
            return
        syncer = threading.Thread(target=self._fsync, name="wire-fsync", daemon=True)
        syncer.start()
        self._syncer = syncer

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._sync_error = exc

    def durable(self) -> None:
        """Wait for ``commit``'s fsync and close the file, which stays at ``path``; if the
        fsync failed, remove the file and raise (a ``WireError``, INTERNAL)."""
        self._join()
        if self._sync_error is not None:
            exc, self._sync_error = self._sync_error, None
            self.abort()
            raise WireError(grpc.StatusCode.INTERNAL, f"spool fsync failed: {exc}") from exc
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _join(self) -> None:
        if self._syncer is not None:
            self._syncer.join()
            self._syncer = None

    def abort(self) -> None:
        """Stop the workers, close and remove the temp file; safe to call twice."""
        self._stop()
        self._join()  # never close the descriptor under a running fsync
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.path = None

    def _stop(self) -> None:
        for stage in self._stages:
            stage.stop()
            self._error = self._error or stage.error
        # Each worker holds a bound method of this sink: a reference cycle that kept the
        # mapped buffer (a whole delta) alive after its round until the cyclic garbage
        # collector happened to run (measured: a relay held most of a round's inputs
        # into the next).  The stopped workers are dropped instead.
        self._stages = []

    def _hash_chunk(self, offset: int, data: Data) -> None:
        self._hash.update(data)
        if self._survey is not None:  # the same chunk, still in this core's cache
            self._survey.feed(data)

    def _copy_chunk(self, offset: int, data: Data) -> None:
        copy_into(self.buffer, offset, data)

    def _write_chunk(self, offset: int, data: Data) -> None:
        write_all(self._fd, data)
        self._written += len(data)
        if self._written - self._synced >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._synced, self._written - self._synced)
            self._synced = self._written


#: At most this many warm files per spool folder (``prepare``).
WARM_MAX = 16
#: Bytes of a warm file mapped at once while its page cache is populated: what warming
#: adds to the process's resident set.  A relay warms its next round's files as its
#: previous round ends, which may be while the islands' next pushes arrive (at once, in
#: bench_sync_scale.py's part A): at 4 MiB its largest resident set there was a warm window
#: on top of its pushes' buffers.
WARM_WINDOW = 1 << 20
#: madvise(2)'s MADV_POPULATE_READ (Linux 5.14).
_MADV_POPULATE_READ = 22
_warm: dict[Path, list[tuple[int, str, int]]] = {}  # folder -> [(fd, path, capacity)]
_warm_lock = threading.Lock()


def prepare(spool_dir: Path, sizes: list[int]) -> int:
    """Make warm files in ``spool_dir`` for transfers of ``sizes`` bytes (the module
    docstring), up to ``WARM_MAX`` in all, beside those already there; how many it made.
    Nothing where the kernel cannot populate a file's page cache (MADV_POPULATE_READ):
    a sparse file alone would save nothing; nor where populating allocates the file
    (tmpfs: its pages would be memory held, not a cache).  Disk errors end it quietly (a transfer then
    writes a fresh file, as without warm files)."""
    folder = Path(spool_dir)
    with _warm_lock:
        have = sorted(cap for _, _, cap in _warm.get(folder, []))
    wanted = sorted((n for n in sizes if n > 0), reverse=True)[:WARM_MAX]
    missing = []
    for n in wanted:  # those no warm file of the folder covers yet
        fit = next((i for i, cap in enumerate(have) if cap >= n), None)
        if fit is None:
            missing.append(n)
        else:
            del have[fit]
    made = 0
    for n in missing:
        try:
            fd, name = new_temp(folder)
        except OSError:
            break
        try:
            os.ftruncate(fd, n)
            # A window at a time: the pages are in the process's resident set only while
            # mapped (a whole file at once raised a relay's peak RSS by its size).
            for at in range(0, n, WARM_WINDOW):
                size = min(WARM_WINDOW, n - at)
                with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                               offset=at) as view:  # fmt: skip
                    view.madvise(_MADV_POPULATE_READ)
                if at == 0 and os.fstat(fd).st_blocks:
                    # Populating allocated the file (tmpfs: its pages are memory, not a
                    # cache the kernel may drop): warm files would hold memory. None here.
                    raise ValueError("not a sparse page cache")
        except (OSError, ValueError):
            os.close(fd)
            Path(name).unlink(missing_ok=True)
            break
        with _warm_lock:
            files = _warm.setdefault(folder, [])
            if len(files) >= WARM_MAX:
                os.close(fd)
                Path(name).unlink(missing_ok=True)
                break
            files.append((fd, name, n))
        made += 1
    return made


def take_warm(spool_dir: Path, size: int) -> tuple[int, str, int] | None:
    """A warm file of ``spool_dir`` for a transfer of ``size`` bytes, now the caller's:
    the smallest that holds it, else the largest (its tail past the warm part is written
    into fresh pages); None if there is none."""
    with _warm_lock:
        files = _warm.get(Path(spool_dir))
        if not files:
            return None
        fits = [f for f in files if f[2] >= size]
        pick = min(fits, key=lambda f: f[2]) if fits else max(files, key=lambda f: f[2])
        files.remove(pick)
        return pick


def discard_warm(spool_dir: Path) -> int:
    """Remove ``spool_dir``'s warm files (a node closing); how many."""
    with _warm_lock:
        files = _warm.pop(Path(spool_dir), [])
    for fd, name, _ in files:
        os.close(fd)
        Path(name).unlink(missing_ok=True)
    return len(files)


def remove_stale(spool_dir: Path) -> int:
    """Remove temp files a crashed process left in ``spool_dir``, and its warm files;
    how many.  Call at start-up."""
    warm = discard_warm(spool_dir)
    stale = list(spool_dir.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}")) if spool_dir.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return warm + len(stale)


def publish_file(temp: Path, digest: str, dest_dir: Path) -> Path:
    """Move a committed temp file to ``dest_dir/digest``; keep an existing file of that name."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / digest
    # os.link is atomic and never replaces; two equal pushes may race here.  Same name
    # = same content digest = same bytes, so the file already there stays.
    with contextlib.suppress(FileExistsError):
        os.link(temp, dest)
    temp.unlink()
    fsync_dir(dest_dir)
    return dest


def write_file(data: Data, digest: str, dest_dir: Path) -> Path:
    """Durably write in-memory bytes to ``dest_dir/digest`` (the no-spool path of publish)."""
    dest = dest_dir / digest
    if dest.exists():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, name = new_temp(dest_dir)
    try:
        write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(name)
        raise
    os.close(fd)
    return publish_file(Path(name), digest, dest_dir)
