"""A node's durable state on disk: tape, published inputs, checkpoints, final markers.

One folder per relay or aggregator (a daemon's ``--state-dir``)::

    tape                      the signed event tape (common/trust/tape.py)
    published/<digest>        every accepted input's encoded bytes (``blob_digest``)
    spool/                    transfers still arriving (the gRPC driver's; never state)
    checkpoints/round-N.pt    the machine's state after global round N (torch.save)
    state.pt                  aggregator: a hard link to the latest checkpoint
    lawa.pt                   aggregator: the LAWA average (RunConfig.lawa), after the last round
    final/<member>            members known to hold the run's final merge (shard eu/1: eu@1)
    pruned                    with keep_rounds, the oldest round kept (``PRUNED_FILE``)
    trash/                    what a prune took away or a crash left, deleted in the background

No state is deleted unless the store keeps a number of rounds (``keep_rounds``, the
daemons' ``--keep-rounds``); what a process that died mid-write left is not state, and a
taped node moves it to the trash once its recovery found tape and folder agree
(``sweep``: temp files of interrupted writes, a checkpoint's as large as the state; an
input published but never taped).  With
``keep_rounds``, after each global round, the checkpoints of older
rounds and the inputs only they need go (``prune``), the tape stays whole, and the run
is auditable from the oldest round kept (a segment audit).  A prune moves the files into
``trash/`` (a rename: the same durable step, in microseconds) and deletes them there off
the driver's lock: deleting a model-sized file frees its page-cache pages and extents,
0.1 s per 400 MB measured here, which a round's pushes would otherwise wait for (three
such files a round at P = 1e8, ten times that at 1e9).  What is in ``trash/`` is
garbage whenever it is found: a store deletes leftovers when it opens.

Small files are written atomically (temp file in the same folder, fsync, rename, fsync of
the folder); ``sync=False`` skips the fsyncs (simulations on a memory file system only).
``crash(point)`` is called at named points between durable steps: the daemons pass a
hook that kills the process there in crash tests, the fault simulation one that raises,
so that every ordering of writes is exercised.

Checkpoints are streamed into their file by ``torch.save`` (no copy of the state in
memory).  A store opened with ``defer=True`` (the aggregator daemon) writes the
checkpoints its node marks deferrable on a background thread, after the round's tape
entry: the node calls ``settle()`` before it changes any tensor a pending checkpoint
refers to, and a restart that finds the entry but not its checkpoint replays the round
from the tape and the published inputs (the node's ``recover``).  With ``hold_s`` such a
write also waits, up to that long, for ``release()``: the daemon releases it once every
member has downloaded the round's merge, so that writing the model down does not take
the cores from serving it (both are CPU work: the state's bytes copied into the page
cache, beside the merge's hashing and copies on the receivers' side); ``settle()``
releases what is held first.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hypertrain.common import planted
from hypertrain.common.aggregate import Blob
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.rounds.replay import PublishedFolder
from hypertrain.common.trust.keys import SigningKey, fsync_dir
from hypertrain.common.trust.schema import InputEntry, Record
from hypertrain.common.trust.tape import Entry, TapeWriter

LAWA_FILE = "lawa.pt"
"""The aggregator's LAWA average, the run's final model when RunConfig.lawa is set."""
STATE_FILE = "state.pt"
"""The aggregator's hard link to its latest checkpoint."""
PRUNED_FILE = "pruned"
"""A node that pruned: ``{"kept_from_round": R}``, written before it deletes anything of
the rounds before R (an auditor starts a segment audit there)."""
MIN_KEEP_ROUNDS = 2
"""The fewest global rounds a pruning node keeps (``keep_rounds``): the newest, from
which it resumes, and the one before, from which a relay recomputes a regional merge of
the last completed round for an island that restarted (its parameters start that round;
the round's inputs are taped after it)."""
TRASH_DIR = "trash"
"""Where a prune moves what it takes away (deleted off the driver's lock), and a sweep what
a crash left."""
FRAGMENT_DIR = "fragment"
"""With streaming fragments, fragment f's node keeps its folder in ``<state-dir>/fragment-f``."""

Crash = Callable[[str], None]
"""A crash hook: called with a point's name where a process may die between two writes."""


def no_crash(point: str) -> None:
    """The hook outside crash tests: nothing happens."""


def temp_prefix(name: str) -> str:
    """How the temp file of an atomic write of ``name`` begins (``_atomic``,
    ``atomic_link``; a sweep finds what a killed write left by it)."""
    return f".{name}."


def temp_prefixes(*names: str) -> tuple[str, ...]:
    """``temp_prefix`` of each of ``names``."""
    return tuple(temp_prefix(name) for name in names)


def _atomic(path: Path, write: Callable[[BinaryIO], None], crash: Crash, sync: bool) -> None:
    """Create ``path`` atomically: ``write`` into a temp file beside it, fsync, rename,
    fsync of the folder (``crash`` is called mid-write and before the rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path.name))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        crash("before_rename")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)


def atomic_write(path: Path, data: Blob, crash: Crash = no_crash, sync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync of the folder."""
    view = memoryview(data)

    def write(f: BinaryIO) -> None:
        f.write(view[: len(view) // 2])
        crash("mid_write")
        f.write(view[len(view) // 2 :])

    _atomic(path, write, crash, sync)


def _torch_save(state: Any, f: BinaryIO | io.BytesIO) -> None:
    """``torch.save`` without the CRC-32 of every record.  torch.load never checks it (a
    flipped byte loads silently, with or without it), so nothing relied on it: computing
    it was pure cost, the larger part of the CPU time of writing a model-sized state
    (about 0.19 of 0.32 core-s per 400 MB on the 2-core box; issue 12).  Every
    checkpoint, node state and island rejoin state is written through here.  The switch
    is scoped to this call: torch's serialization config is per thread (the daemons save
    on writer threads, which a value set at import never reached), and other code's
    saves keep torch's default."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, f)
    finally:
        torch.serialization.set_crc32_options(before)


def atomic_save(path: Path, state: Any, crash: Crash = no_crash, sync: bool = True) -> None:
    """``torch.save(state)`` to ``path`` atomically, streamed into the file (tensors are
    written from their own memory, never copied into a buffer first)."""

    def write(f: BinaryIO) -> None:
        _torch_save(state, f)
        crash("mid_write")

    _atomic(path, write, crash, sync)


def atomic_link(source: Path, path: Path, sync: bool = True) -> None:
    """Make ``path`` a hard link to ``source`` atomically (link under a temp name, rename)."""
    tmp = path.parent / f"{temp_prefix(path.name)}{os.getpid()}.{threading.get_ident()}.link"
    tmp.unlink(missing_ok=True)
    os.link(source, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)


def checkpoint_path(folder: Path, round_: int) -> Path:
    """A node's checkpoint of global round ``round_`` (``folder``: its state folder)."""
    return folder / "checkpoints" / f"round-{round_:06d}.pt"


def checkpoints_of(folder: Path) -> dict[int, Path]:
    """A node's checkpoints on disk by round, oldest first (temp files of a write in
    flight, named with a leading dot, are not among them)."""
    found = sorted((folder / "checkpoints").glob("round-*.pt"))
    return {int(p.stem.split("-")[1]): p for p in found}


def check_keep_rounds(keep_rounds: int) -> None:
    """ConfigError unless ``keep_rounds`` is 0 (keep every round) or MIN_KEEP_ROUNDS or more."""
    if keep_rounds != 0 and keep_rounds < MIN_KEEP_ROUNDS:
        raise ConfigError(
            f"keep_rounds must be 0 (keep every round) or at least {MIN_KEEP_ROUNDS} (the "
            f"newest round, and the one before, which the last completed round starts from), "
            f"got {keep_rounds}"
        )


@dataclass(frozen=True)
class Pruned:
    """What one ``NodeStore.prune`` took away: checkpoints of rounds before ``kept_from``
    (``checkpoints`` files) and ``inputs`` published inputs; ``bytes`` in all (moved to
    the trash, deleted there by the store's thread)."""

    kept_from: int
    checkpoints: int
    inputs: int
    bytes: int
    error: str = ""
    """Why it stopped short (a file that could not be read or taken away); "" if it did not."""
    trash_error: str = ""
    """What the store's thread could not delete from the trash since the last prune (it
    stays there and is tried again); "" if nothing."""


@dataclass(frozen=True)
class Swept:
    """What ``NodeStore.sweep`` found of a process that died mid-write."""

    files: int
    """Files moved to the trash (temp files, and the untaped input)."""
    bytes: int
    untaped_kept: int = 0
    """Published inputs no entry names that it left where they are: the tape began with
    this open, or there were more than a crash leaves (``MAX_UNTAPED``)."""
    error: str = ""
    """A file it could not move or delete (it stays: the next start tries again)."""


MAX_UNTAPED = 1
"""The most published inputs without an entry that a crash leaves in a node's folder."""


def _discard(path: Path, trash: Path) -> int | None:
    """Move ``path`` into ``trash`` (named by its folder and its own name, so that a
    checkpoint and an input never meet there) if it is there; its size (None if it was
    not).  A folder in its place is an error, as deleting it would be.  A trash that is
    gone is made again; across file systems (a folder mounted apart) it is deleted here."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a folder, not pruned", str(path))
    target = trash / f"{path.parent.name}-{path.name}"
    try:
        os.replace(path, target)
    except FileNotFoundError:
        if not os.path.lexists(path):
            return None  # gone meanwhile
        trash.mkdir(parents=True, exist_ok=True)  # the trash was removed: made again
        os.replace(path, target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        path.unlink()
    return st.st_size


def empty_trash(trash: Path) -> list[str]:
    """Delete everything in ``trash`` (a store's ``TRASH_DIR``); the errors, one line
    each (what could not be deleted stays, for the next time)."""
    errors: list[str] = []
    try:
        found = list(trash.iterdir())
    except FileNotFoundError:
        return errors
    except OSError as e:
        return [f"{type(e).__name__}: {e}"]
    for path in found:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def _first(errors: list[str]) -> str:
    """The first of ``errors``, and how many more there were."""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return errors[0] + more


def remove_temps(folder: Path, *names: str) -> tuple[int, int]:
    """Delete the temp files that interrupted atomic writes of ``names`` left in
    ``folder`` (a process killed mid-write); (files, bytes).  Call at start-up, before
    anything writes those files."""
    files = size = 0
    if not folder.is_dir():
        return 0, 0
    for path in folder.iterdir():
        if path.name.startswith(temp_prefixes(*names)) and path.is_file():
            with contextlib.suppress(FileNotFoundError):
                n = path.stat().st_size
                path.unlink()
                files, size = files + 1, size + n
    return files, size


def pruned_from(folder: Path) -> int | None:
    """From a node's folder: the oldest global round it keeps since it pruned older ones
    (``PRUNED_FILE``; None: it never pruned, every round it committed is there)."""
    try:
        return int(json.loads((folder / PRUNED_FILE).read_text())["kept_from_round"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise HypertrainError(f"{folder / PRUNED_FILE} is not a pruning marker: {e}") from None


def save_state(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    _torch_save(state, buf)
    return buf.getvalue()


def load_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


class NodeStore:
    """The folder of one relay or aggregator (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        run_id: str,
        key: SigningKey | None,
        *,
        sync: bool = True,
        crash: Crash = no_crash,
        checkpoint_every: int | None = None,
        defer: bool = False,
        hold_s: float = 0.0,
        writer_init: Callable[[], None] | None = None,
        keep_rounds: int = 0,
        on_prune: Callable[[Pruned], None] | None = None,
        on_sweep: Callable[[Swept], None] | None = None,
    ) -> None:
        """``key``: the node's signing key; without one nothing is taped (and a restart
        cannot resume).  ``checkpoint_every``: tape entries between signed tape checkpoints
        (None: the tape's default).  ``defer``: write deferrable checkpoints on a background
        thread; ``hold_s``: each of them first waits up to this long for ``release()`` (see
        the module docstring); ``writer_init``: run first on that thread and on the one
        that empties the trash (e.g. to lower their CPU priority).  ``keep_rounds``: keep the checkpoints of this many global rounds
        and the inputs taped after the oldest of them (``prune``; 0: everything, the whole
        run stays auditable), and tell ``on_prune`` what each prune deleted (the daemons
        log it).  ``on_sweep``: told what ``sweep`` found, when it found anything."""
        check_keep_rounds(keep_rounds)
        self.keep_rounds = keep_rounds
        self.on_prune = on_prune
        self._pruned_to = 0  # the tape position the last prune kept inputs from
        self.folder = folder
        self.sync = sync
        self.crash = crash
        self.published = folder / "published"
        self.spool = folder / "spool"
        self.checkpoints = folder / "checkpoints"
        self.final = folder / "final"
        self.trash = folder / TRASH_DIR
        for d in (self.published, self.spool, self.trash):
            d.mkdir(parents=True, exist_ok=True)
        kw: dict[str, Any] = {"sync": sync}
        if checkpoint_every is not None:
            kw["checkpoint_every"] = checkpoint_every
        self.tape = TapeWriter.open(folder / "tape", run_id, key, **kw) if key else None
        self.key_id = key.key_id if key else ""
        self.blobs = PublishedFolder(self.published)
        self.closed = False
        self._writer = (
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="checkpoint", initializer=writer_init
            )
            if defer
            else None
        )
        self._pending: list[Future[None]] = []
        self.hold_s = hold_s
        self._held: list[threading.Event] = []
        self._writer_init = writer_init
        self._deleter: ThreadPoolExecutor | None = None
        """Empties the trash off the driver's lock (started at the first need; a store
        that does not fsync, the fault simulation's, empties it inline instead)."""
        self._trash_errors: list[str] = []
        """What the last emptying could not delete (said by the next prune)."""
        self._trash_lock = threading.Lock()
        self.on_sweep = on_sweep
        self._new_tape = self.tape is not None and not self.tape.entries
        """The tape began with this open: it says nothing of what the folder held before."""
        if any(self.trash.iterdir()):  # what a stop left there
            self._empty_trash()

    @property
    def taped(self) -> bool:
        return self.tape is not None

    def entries(self) -> list[Entry]:
        """Every verified entry of the tape (what a restart replays)."""
        return list(self.tape.entries) if self.tape is not None else []

    def record(self, rec: Record) -> Entry | None:
        """Append one record to the tape, durably (None when the node keeps no tape).  After
        ``close`` a taped node refuses: what cannot be taped must not be acted on."""
        if self.tape is None:
            if self.closed and self.key_id:
                raise HypertrainError(f"tape closed: cannot record {rec.KIND}")
            return None
        return self.tape.append(rec.KIND, rec.to_body())

    def publish(self, digest: str, data: Blob) -> None:
        """Keep an accepted input's bytes under its digest (idempotent)."""
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise HypertrainError(
                f"refusing to publish under {digest!r}: not a blob digest (64 hex)"
            )
        path = self.published / digest
        if not path.exists():
            atomic_write(path, data, sync=self.sync)

    @property
    def tape_position(self) -> tuple[int, str]:
        """(entries so far, hash of the last): what a checkpoint records."""
        if self.tape is None:
            return 0, ""
        return self.tape.next_seq, self.tape.head

    def write_checkpoint(
        self, round_: int, state: dict[str, Any], copy_as: str = "", deferrable: bool = False
    ) -> None:
        """``checkpoints/round-N.pt`` (and ``copy_as`` in the folder, e.g. state.pt, a hard
        link to it).  ``deferrable``: the caller tolerates the write finishing later (on a
        store opened with ``defer``): the tensors in ``state`` must then stay unchanged
        until ``settle()``."""
        if deferrable and self._writer is not None:
            gate = threading.Event()
            if self.hold_s > 0:
                self._held.append(gate)
            else:
                gate.set()
            self._pending.append(
                self._writer.submit(self._write_after, gate, round_, state, copy_as)
            )
        else:
            self._write(round_, state, copy_as)

    def _write_after(
        self, gate: threading.Event, round_: int, state: dict[str, Any], copy_as: str
    ) -> None:
        gate.wait(self.hold_s)
        self._write(round_, state, copy_as)

    def release(self) -> None:
        """Let the held checkpoint writes start now (``hold_s``; the caller holds the
        node's lock, as ``settle`` does)."""
        held, self._held = self._held, []
        for gate in held:
            gate.set()

    def _write(self, round_: int, state: dict[str, Any], copy_as: str) -> None:
        path = checkpoint_path(self.folder, round_)
        atomic_save(path, state, self.crash, self.sync)
        if copy_as:
            self.crash("between_checkpoints")
            atomic_link(path, self.folder / copy_as, self.sync)

    def settle(self) -> None:
        """Wait for the deferred checkpoint writes (releasing the held ones); a failed one
        is raised here."""
        self.release()
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except OSError as e:
                raise HypertrainError(f"writing a checkpoint in {self.checkpoints}: {e}") from e

    def write_average(self, state: dict[str, Any]) -> None:
        """``lawa.pt``: the run's LAWA average (RunConfig.lawa), atomically."""
        atomic_save(self.folder / LAWA_FILE, state, self.crash, self.sync)

    def has_average(self) -> bool:
        return (self.folder / LAWA_FILE).exists()

    def latest_checkpoint(self) -> Path | None:
        found = list(checkpoints_of(self.folder).values())
        return found[-1] if found else None

    def prune(self) -> Pruned | None:
        """With ``keep_rounds`` K: delete the checkpoints of all but the K newest rounds on
        disk, then the published inputs that only tape entries before the oldest kept one
        refer to; report it to ``on_prune`` and return it (None: nothing to delete, or
        K = 0: keep everything).

        What is kept is what anything still reads: a restart resumes from the newest
        checkpoint and the inputs taped after it; a relay recomputes a regional merge of
        the last completed round from that round's first parameters (the checkpoint before)
        and its inputs (an older one it no longer can: the asker takes a newer merge, as
        one left behind at a cutoff does); a segment audit starts from any kept round
        (``hypertrain audit --from-round``).  Checkpoints go first, so a crash midway leaves inputs nobody
        needs (deleted next time), never a kept checkpoint without its inputs.  An input
        published and not taped yet (the driver's lock is held here, so none is) or taped
        again after the oldest kept checkpoint stays.  A file that cannot be deleted is
        reported (``Pruned.error``, the first of its errors), not raised, and the others are
        still deleted: the round is durable either way, and the next round tries again.
        "Deleted" here is moved into the trash, which a thread then empties
        (``_empty_trash``); what it could not delete the next prune reports.
        Call under the driver's lock, after a global round's entry."""
        k = self.keep_rounds
        found = checkpoints_of(self.folder)
        if k == 0 or self.tape is None or len(found) <= k:
            return None
        kept_from = list(found)[-k]
        oldest, files = found[kept_from], list(found.values())
        done = Pruned(kept_from, 0, 0, 0)
        errors: list[str] = []

        def remove(path: Path) -> int | None:
            try:
                return _discard(path, self.trash)
            except OSError as e:  # say it, and go on with the others
                errors.append(f"{type(e).__name__}: {e}")
                return None

        try:
            # First the marker (an auditor starts from the round it names), then the files.
            if self.pruned_from() != kept_from:
                marker = json.dumps({"kept_from_round": kept_from}, sort_keys=True)
                atomic_write(self.folder / PRUNED_FILE, marker.encode(), sync=self.sync)
                self.crash("prune_marked")
            start = int(torch.load(oldest, weights_only=True, mmap=True)["tape_seq"])
            entries = self.tape.entries
            needed = {e.body["digest"] for e in entries[start:] if e.kind == InputEntry.KIND}
            # (entries before the last prune's start were dealt with then)
            spent = {
                e.body["digest"]
                for e in entries[self._pruned_to : start]
                if e.kind == InputEntry.KIND
            } - needed
            for path in files[:-k]:
                size = remove(path)
                if size is not None:
                    done = replace(done, checkpoints=done.checkpoints + 1, bytes=done.bytes + size)
            if self.sync:
                fsync_dir(self.checkpoints)
            self.crash("prune_mid")
            for digest in sorted(spent):
                size = remove(self.published / digest)
                if size is not None:
                    done = replace(done, inputs=done.inputs + 1, bytes=done.bytes + size)
            if self.sync:
                fsync_dir(self.published)
            if not errors:
                self._pruned_to = start
        except (OSError, KeyError, RuntimeError, ValueError, HypertrainError) as e:
            errors.append(f"{type(e).__name__}: {e}")  # e.g. an unreadable checkpoint
        with self._trash_lock:  # what the last emptying of the trash could not delete
            trash_errors, self._trash_errors = self._trash_errors, []
        if done.checkpoints or done.inputs or trash_errors:
            self._empty_trash()
        if errors:
            done = replace(done, error=_first(errors))
        if trash_errors:
            done = replace(done, trash_error=f"emptying {self.trash}: {_first(trash_errors)}")
        if self.on_prune is not None:
            self.on_prune(done)
        return done

    def sweep(self) -> Swept:
        """Move into the trash what a process that died mid-write left in this folder:
        the temp files of interrupted atomic writes (a checkpoint's is the size of the
        state) and a published input that no tape entry names (published, then the
        process died before its entry: nothing reads it, and a sender that sends it again
        publishes it again), then deletes them there (on this thread: it runs at a start,
        and what it cannot delete is said now, ``Swept.error``).  Told to ``on_sweep``
        when it found anything.

        The node calls it once its recovery found the tape and the folder agree (a
        refused start leaves the folder as it was, for whoever looks into it), on a taped
        store only (its tape's lock keeps any other taped process out).  A tape that began
        with this open says nothing of the folder's inputs, which then stay; and as a
        crash leaves at most one untaped input (publishing and taping one are one step
        under the node's lock), several untaped ones are not a crash's: they stay and are
        reported (``Swept.untaped_kept``)."""
        found = [] if self.tape is None or planted.on("no_sweep") else self.leftovers()
        untaped = [p for p in found if p.parent == self.published and not p.name.startswith(".")]
        kept = len(untaped) if self._new_tape or len(untaped) > MAX_UNTAPED else 0
        if kept:
            found = [p for p in found if p not in untaped]
        files = size = 0
        errors: list[str] = []
        for path in found:
            try:
                moved = _discard(path, self.trash)
            except OSError as e:  # it stays; said below
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if moved is not None:
                files, size = files + 1, size + moved
        if files and self.sync:
            for folder in (self.checkpoints, self.published, self.folder):
                if folder.is_dir():
                    fsync_dir(folder)
        if files:  # here, not on the thread: at a start, and what fails is said now
            errors += [f"emptying {self.trash}: {e}" for e in empty_trash(self.trash)]
        swept = Swept(files, size, kept, _first(errors) if errors else "")
        if (files or kept or errors) and self.on_sweep is not None:
            self.on_sweep(swept)
        return swept

    def leftovers(self) -> list[Path]:
        """What a process that died mid-write would have left here (``sweep`` takes it
        at a start; the fault simulation checks, at a schedule's end, that none is left)."""
        if self.tape is None:
            return []
        taped = {e.body["digest"] for e in self.tape.entries if e.kind == InputEntry.KIND}
        found = list(self.checkpoints.glob(".*"))
        found += [p for p in self.published.iterdir() if p.name not in taped]  # temps too
        temps = temp_prefixes(LAWA_FILE, STATE_FILE, PRUNED_FILE)
        return found + [p for p in self.folder.iterdir() if p.name.startswith(temps)]

    def _empty_trash(self) -> None:
        """Delete what is in the trash: on a thread of its own (inline where the store does
        not fsync: the fault simulation stays on one thread)."""
        if self.sync:
            try:
                if self._deleter is None:
                    self._deleter = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="trash", initializer=self._writer_init
                    )
                self._deleter.submit(self._emptied)
                return
            except RuntimeError:  # no thread to be had (a limit, or shutting down): here
                pass
        self._emptied()

    def _emptied(self) -> None:
        errors = empty_trash(self.trash)
        with self._trash_lock:
            self._trash_errors = errors

    def wait_trash(self) -> None:
        """Wait until what was moved to the trash so far is deleted (or failed to be)."""
        if self._deleter is not None and not self.closed:
            self._deleter.submit(lambda: None).result()

    def pruned_from(self) -> int | None:
        """The oldest round this node still keeps, if it has pruned (None: it has not)."""
        return pruned_from(self.folder)

    def has_state(self) -> bool:
        """Did an earlier start leave state here?"""
        return self.latest_checkpoint() is not None or any(self.published.iterdir())

    def mark_final(self, member: str) -> None:
        path = self.final / member.replace("/", "@")  # a relay shard "eu/1" is "eu@1" here
        if not path.exists():
            atomic_write(path, b"", sync=self.sync)

    def finals(self) -> set[str]:
        if not self.final.is_dir():
            return set()
        return {
            f.name.replace("@", "/") for f in self.final.iterdir() if not f.name.startswith(".")
        }

    def close(self) -> None:
        """The deferred checkpoints written (and, with ``keep_rounds``, the rounds they make
        surplus pruned), a final signed tape checkpoint (the tape's end is attested), then
        no more entries."""
        try:
            self.settle()
            self.prune()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            if self._deleter is not None:  # the deletes under way finished
                self._deleter.shutdown(wait=True)
        tape, self.tape = self.tape, None
        self.closed = True
        if tape is not None:
            cp = tape.last_checkpoint
            if tape.next_seq and (cp is None or cp.size < tape.next_seq - 1):
                tape.checkpoint()
            tape.close()
