"""The ledger's model snapshot: a start loads the model instead of replaying the journal.

**Why** (issue #30 item 4): every engine's start replays the root's journal whole
(:meth:`~vllm_adapter.disk.ledger_model.LedgerModel._sync`): each ``add`` decoded and
built into the reference's :class:`~reference.eviction.Disk` and
:class:`~reference.prefix_structure.PrefixStructure`, 5.6 s per 100k files warm
(``reports/bench.md``, "a tier's start over a full root").  The snapshot is one file,
``<root>/kvchunk-ledger.snap``, holding the model a fresh replay of the journal's first
``L`` bytes builds, so a start loads it and replays only what was appended after ``L``.

**When it is written** (:meth:`~vllm_adapter.disk.ledger.RootLedger.save_snapshot`,
under the root's lock): after a compaction and when the tier shuts down
(:meth:`~vllm_adapter.disk.ledger.RootLedger.close`).  What it holds is never the
engine's own model (which holds what this engine observed itself, and ids and clock
ticks of refused stores): it is a fresh replay of the journal, built for the write
(:func:`replay`, from the current snapshot and the tail when that binds, else from the
whole journal), so that a start from it builds the model a full replay builds.  The
shutdown's write first checks every written file's size against its record (``size``
records where it differs, as a start does) and the snapshot says so (:data:`VERIFIED`).

**What binds it to the journal**: ``L`` and the XXH3-128 digest of the journal's first
``L`` bytes (a whole number of lines), and, per namespace, the full-attention groups of
the chunking the replay judged it with (the engine's, given to the ledger; they decide
which keys a file's model counts as full-attention).  Not the inode: the model is a
function of the bytes, and a journal rewritten with the same bytes gives the same model
(a compaction by another engine, or any rewrite, changes the bytes: a new digest).  Not
the budget or the rule: replaying records reads neither (the recorded budget is a record
of the journal, so it is in the model).

**How a start trusts it** (:func:`load`): the file is checked whole (magic, version, its
length, the XXH3-128 digest of its payload), then the binding against the journal now on
disk (``L`` at most its length, at a line's end, the digest of its first ``L`` bytes), then
each namespace's chunking; then the reservations and totals are read and checked as they
are installed (the type of every field, every size, id and count, each namespace's files
counted against the reservations).  Anything else -- missing, damaged, stale, another
version or chunking, any error reading it -- and the journal is replayed whole, as without
a snapshot; :attr:`~vllm_adapter.disk.ledger_model.LedgerModel.snapshot_start` says which
(``used`` or why not) and the budget counters count both.  A snapshot never makes a model
a full replay would not: it is the full replay's state, bound to the bytes it was replayed
from (``tests/test_ledger_snapshot.py`` checks it field by field after random runs of
every operation, a crash at each step of writing it, and another engine appending).

**Each namespace is built on first need** (:class:`~vllm_adapter.disk.ledger_model.DeferredNamespace`,
``tests/test_ledger_snapshot_deferred.py``): its prefix structure and Disk (most of the
payload, most of a start's time: 2 s per 100k files to decode and build) are one
:mod:`marshal` blob of their own, decoded and built (:func:`_build`, every field checked,
the totals recomputed; the key collections' own items are not checked one by one: see
:func:`_keys`) by the first operation that reads them: a store, an eviction, a read of a
file's keys, the journal's tail when it names the namespace.  A start needs only what the
load installs: the reservations, each namespace's bytes, stranded bytes and chunking, and
which files are written (those not pending: the build checks each record agrees).  The
stranded bytes are the namespace's when the snapshot was written (nothing changes them while
it is unbuilt), so the gauge vLLM's scheduler thread reads never pays a build.  A build whose
fields do not hold (the payload's digest was checked at the load, so only a payload forged
with its digest gets there) falls back to the full replay, as a start without the snapshot
would have replayed: the model becomes the journal's full replay up to where it stands
(:meth:`~vllm_adapter.disk.ledger_model.LedgerModel._snapshot_damaged`, once, under the
model's lock; every namespace takes its part of it, none is built from the payload any more,
the operation that built it goes on with that model; counted in ``snapshot_fallbacks``,
logged), and the engine's snapshots are written from full replays from then on.  A record
builds the namespaces it names before it changes anything, so the replay stops at that
record, which is then applied to it.  A snapshot written while a namespace is unbuilt writes
its blob again.

**Sizes at a start** (:meth:`~vllm_adapter.disk.ledger.RootLedger._reconcile_sizes`): a
start from a snapshot the shutdown wrote does not ``stat`` the files the snapshot holds
(one ``stat`` per file was 3 s per 100k files with a cold page cache): their records are
byte for byte the ones the shutdown checked against the files, and a written file's size
changes after its ``done`` only by a new reservation of its path, which is in the
journal's tail (its file is ``stat``-ed).  A start from a compaction's snapshot, or from
the journal, checks every file as before.  What is left unchecked is a file changed by
something other than kvchunk between a shutdown and the next start (while engines run,
nothing checks that either; the index's snapshot is validated against a listing of names
only, each load checks its file's identity).

**The format** (version 2; a snapshot of another version is not used): nothing is pickled
(the root may be shared): the payload is :mod:`marshal` of plain types only (ints, bytes,
str, tuples, lists, frozensets, None), which builds no object but those and runs no code,
and is read back field by field into the model's classes::

    magic "KVCLSNAP" (8) | version (2) | marshal version (2) | flags (2): VERIFIED | L (8)
    | journal digest (16): XXH3-128 of the journal's first L bytes
    | payload bytes (8) | payload digest (16): XXH3-128 of the payload
    | payload: marshal of (recorded budget, clock, skipped lines,
                           namespaces: [(name, chunking binding, files, bytes, blob)],
                           reservations (columns: paths, rids, namespaces, fids, owners,
                                         line bytes), pending paths)
      blob: marshal of (prefix structure, Disk, the order of the namespace's fids)

**Cost and bound**: about 100 bytes per key and 150 per file (the keys once each, the
prefix structure's tables, the paths and ids): 1,122 bytes per file of the budget bench's
11 keys, 1.26x its journal.  A tier writes it only when it fits :data:`RESERVE_SHARE` of
the ledger's reserve (an older one is removed then; a journal whose live records alone
pass that share is not even replayed for it): the journal compacts at half the reserve,
the quarantine keeps a quarter, the index snapshot an eighth, and this one takes a
sixteenth, so the root stays within ``disk_bytes_to_use``.  Sections of 512 KiB and more
always fit (per section, a sixteenth of the reserve is ``section bytes / 2048``); the
budget bench's 4 KiB sections do not (the bench writes it without the cap and says by
how much, as for the index snapshot).  Writing it costs a replay of the journal (from
the current snapshot when that binds: its namespaces the tail does not name are written
again unbuilt) and, at shutdown, one ``stat`` per file.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import glob
import itertools
import marshal
import os
import struct
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from reference.eviction import Disk, EvictionRule
from reference.knobs import Chunking
from reference.prefix_structure import PrefixStructure
from vllm_adapter.disk.ledger_model import Damaged, DeferredNamespace

if TYPE_CHECKING:
    from vllm_adapter.disk.ledger_model import LedgerModel, Namespace

__all__ = [
    "RESERVE_SHARE",
    "SNAPSHOT_FILE",
    "Damaged",
    "chunking_binding",
    "encode",
    "journal_digest",
    "load",
    "remove_partial",
    "replay",
    "write",
]

SNAPSHOT_FILE = "kvchunk-ledger.snap"
"""In the root, beside the journal."""
PARTIAL_SUFFIX = ".writing"
"""A snapshot being written: ``kvchunk-ledger.snap.<owner>.writing``, renamed over
:data:`SNAPSHOT_FILE` once whole (one left by a crash is removed by the next write)."""
MAGIC = b"KVCLSNAP"
VERSION = 2
MARSHAL_VERSION = 4
RESERVE_SHARE = 16
"""The snapshot takes at most this share of the ledger's reserve (the module docstring)."""
_HEAD = struct.Struct("<8sHHHQ16sQ16s")
VERIFIED = 1
"""A flag: the writer checked every written file's size against the model (:meth:`RootLedger.close`)."""
_DISK_FIELDS = frozenset({"structure", "files", "file_of", "bytes", "peak_bytes", "clock",
                          "_next_id", "_dependents", "_leaves", "_recency", "_windows_only"})
"""A :class:`~reference.eviction.Disk`'s state, every field of it: a model whose Disk holds
anything else is not written (a field added to the class needs this module too)."""
_STRUCTURE_FIELDS = frozenset({"chunking", "window_rule", "alignment", "full_groups", "parent",
                               "children", "full_at", "windows_at", "serves", "end_token"})


def journal_digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def chunking_binding(chunking: Chunking | None) -> tuple[int, ...] | None:
    """What of a namespace's chunking its replayed model depends on: the full-attention
    groups (:meth:`~reference.prefix_structure.PrefixStructure.is_full`), or None."""
    return None if chunking is None else tuple(sorted(chunking.full_groups))


# -- writing ------------------------------------------------------------------


def _canon(table: dict[bytes, bytes], keys: Any) -> list[bytes]:
    """``keys`` as one object per value (:mod:`marshal` writes an object it saw before as a
    reference: a key that many files and boundaries name is written once)."""
    return [table.setdefault(k, k) for k in keys]


def _disk_state(disk: Disk, canon: dict[bytes, bytes]) -> tuple[Any, ...]:
    if set(vars(disk)) != _DISK_FIELDS:
        raise ValueError(f"a Disk with fields {sorted(vars(disk))}: not snapshotted")
    files = list(disk.files.values())
    next_id, dependents, leaves, recency, windows_only = disk.bookkeeping()
    return (list(disk.files), [tuple(_canon(canon, f.keys)) for f in files],
            [f.nbytes for f in files], [f.last_use for f in files], [f.ready for f in files],
            [f.pins for f in files], _canon(canon, disk.file_of), list(disk.file_of.values()),
            (disk.bytes, disk.peak_bytes, disk.clock, next_id), list(dependents),
            list(dependents.values()), leaves, recency, windows_only)


def _structure_state(s: PrefixStructure, canon: dict[bytes, bytes]) -> tuple[Any, ...]:
    if set(vars(s)) != _STRUCTURE_FIELDS or s.end_token:
        raise ValueError("a prefix structure fed by more than records: not snapshotted")
    return (_canon(canon, s.parent), [None if p is None else canon.setdefault(p, p)
                                       for p in s.parent.values()],
            _canon(canon, s.children), [set(_canon(canon, c)) for c in s.children.values()],
            _canon(canon, s.full_at), [tuple(_canon(canon, f)) for f in s.full_at.values()],
            [frozenset(_canon(canon, s.windows_at[b])) for b in s.full_at],
            _canon(canon, s.serves), [_canon(canon, b) for b in s.serves.values()])


def namespace_blob(space: Namespace) -> bytes:
    """One namespace's part of the payload: :mod:`marshal` of its prefix structure, its
    Disk and the order of its paths (the paths themselves are the reservations')."""
    if isinstance(space, DeferredNamespace) and not space.built:
        return space.source  # loaded and never changed since: the bytes it was built from
    if list(space.structure.full_at) != list(space.structure.windows_at):
        raise ValueError("a prefix structure whose boundaries disagree: not snapshotted")
    canon: dict[bytes, bytes] = {}
    return marshal.dumps((_structure_state(space.structure, canon),
                          _disk_state(space.disk, canon), list(space.path_of)), MARSHAL_VERSION)


def encode(model: LedgerModel, journal: bytes | memoryview, verified: bool = False) -> bytes:
    """The snapshot file's bytes of ``model``, a fresh replay of ``journal`` (its first
    ``model._offset`` bytes, whole lines), with ``model._chunkings``' bindings;
    ``verified``: the writer found every written file's size equal to its record."""
    length = model._offset
    names: dict[str, str] = {}
    spaces = []
    files = collections.Counter(r.ns for r in model._res.values())
    for ns, space in model._spaces.items():
        spaces.append((names.setdefault(ns, ns), chunking_binding(model._chunkings.get(ns)),
                       files[ns], space.file_bytes(), space.stranded_bytes(),
                       namespace_blob(space)))
    res = list(model._res.values())
    columns = (list(model._res), [r.rid for r in res], [names.setdefault(r.ns, r.ns) for r in res],
               [r.fid for r in res], [names.setdefault(r.owner, r.owner) for r in res],
               [r.line_bytes for r in res])
    state = (model._recorded_budget, model._clock,
             model.counters.as_dict()["journal_records_skipped"], spaces, columns,
             sorted(model._pending))
    payload = marshal.dumps(state, MARSHAL_VERSION)
    head = _HEAD.pack(MAGIC, VERSION, MARSHAL_VERSION, VERIFIED if verified else 0, length,
                      journal_digest(memoryview(journal)[:length]), len(payload),
                      journal_digest(payload))
    return head + payload


def remove_partial(root: str) -> None:
    """Remove snapshots a crashed writer left half written (called under the root's lock:
    no other writer is running)."""
    for path in glob.glob(glob.escape(os.path.join(root, SNAPSHOT_FILE)) + ".*" + PARTIAL_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def write(root: str, owner: str, data: bytes, io: Any) -> None:
    """Write ``data`` as the root's snapshot atomically (a temporary file renamed over
    :data:`SNAPSHOT_FILE`; a start reads the old one or the new one), through the ledger's
    I/O (``io.write``, ``io.replace``: where a test injects its faults)."""
    path = os.path.join(root, SNAPSHOT_FILE)
    tmp = f"{path}.{owner}{PARTIAL_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = io.write(fd, bytes(view[: 1 << 24]))
            if n <= 0:
                raise OSError(28, "the snapshot's write made no progress")  # ENOSPC
            view = view[n:]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        io.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- reading ------------------------------------------------------------------


def _check(ok: bool) -> None:
    if not ok:
        raise Damaged("a field of the wrong type")


def _of(values: Any, *kinds: type) -> list[Any]:
    """``values``, a list whose items are all of ``kinds`` (Damaged: not)."""
    _check(type(values) is list and set(map(type, values)) <= set(kinds))
    return values  # type: ignore[no-any-return]


def _counts(values: Any) -> list[int]:
    _check(min(_of(values, int), default=0) >= 0)
    return values  # type: ignore[no-any-return]


def _flat(values: list[Any], *kinds: type) -> None:
    """Every item of every collection in ``values`` is of ``kinds``."""
    _check(set(map(type, itertools.chain.from_iterable(values))) <= set(kinds))


def _keys(values: Any, kind: type) -> list[Any]:
    """``values``, a list of ``kind`` collections of keys.  Their keys are not checked one
    by one (millions of them, a third of the load's time): the payload's digest vouches
    for them against damage, and a key of another type, which only a payload forged with
    its digest could hold, builds no object but a plain one and makes no file count less
    (sizes, ids and counts are all checked)."""
    return _of(values, kind)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def load(model: LedgerModel, journal: bytes) -> str:
    """Install the snapshot of ``model``'s root into ``model`` (fresh: just reset) when it
    binds ``journal`` (the journal's bytes now); ``used``, or why not (``missing``,
    ``damaged``, ``version``, ``stale``, ``chunking``), the model then left reset."""
    try:
        data = _read(os.path.join(os.path.dirname(model.ledger_path), SNAPSHOT_FILE))
    except OSError:
        return "unreadable"
    if data is None:
        return "missing"
    if len(data) < _HEAD.size:
        return "damaged"
    magic, version, mversion, flags, length, bound, size, digest = _HEAD.unpack_from(data)
    if magic != MAGIC or len(data) != _HEAD.size + size:
        return "damaged"
    if version != VERSION or mversion != MARSHAL_VERSION:
        return "version"
    payload = memoryview(data)[_HEAD.size:]
    if journal_digest(payload) != digest:
        return "damaged"
    if length > len(journal) or (length and journal[length - 1] != 0x0A):
        return "stale"
    if journal_digest(memoryview(journal)[:length]) != bound:
        return "stale"
    collecting = gc.isenabled()
    gc.disable()  # millions of containers, none garbage: no collection pass over them
    try:
        state = marshal.loads(payload)
        why = _install(model, state, length)
    except (ValueError, TypeError, EOFError, KeyError, IndexError, AttributeError,
            OverflowError):
        why = "damaged"
    finally:
        if collecting:
            gc.enable()
    if why != "used":
        model._reset()
    elif flags & VERIFIED:  # the sizes of the files written then (not of those pending)
        pending = model._pending
        model._verified = {p: r.rid for p, r in model._res.items() if p not in pending}
    return why


def _install(model: LedgerModel, state: Any, length: int) -> str:
    """Install a snapshot's payload into ``model``: the reservations and totals checked and
    built now, each namespace deferred (:class:`DeferredNamespace`, built by :func:`_build`
    on first access).  Damaged: a field does not hold."""
    from vllm_adapter.disk.ledger_model import Reservation

    _check(type(state) is tuple and len(state) == 6)
    budget, clock, skipped, spaces, columns, pending = state
    _check((budget is None or type(budget) is int) and type(clock) is int
           and type(skipped) is int and type(columns) is tuple and len(columns) == 6)
    for entry in _of(spaces, tuple):
        _check(len(entry) == 6 and type(entry[0]) is str and type(entry[2]) is int
               and type(entry[3]) is int and type(entry[4]) is int
               and min(entry[2], entry[3], entry[4]) >= 0 and entry[4] <= entry[3]
               and type(entry[5]) is bytes)
        if entry[1] != chunking_binding(model._chunkings.get(entry[0])):
            return "chunking"
    paths, rids, nss, fids, owners, line_bytes = columns
    _of(paths, str)
    _of(rids, str)
    _of(nss, str)
    _counts(fids)
    _of(owners, str)
    _counts(line_bytes)
    _check(len(paths) == len(rids) == len(nss) == len(fids) == len(owners) == len(line_bytes))
    res = dict(zip(paths, map(Reservation, rids, nss, fids, owners, line_bytes), strict=True))
    by_rid = dict(zip(rids, paths, strict=True))
    files = {entry[0]: entry[2] for entry in spaces}
    _check(len(res) == len(paths) == len(by_rid) and len(files) == len(spaces)
           and collections.Counter(nss) == {ns: n for ns, n in files.items() if n}
           and set(_of(pending, str)) <= res.keys())
    for ns, _, count, nbytes, stranded, blob in spaces:
        chunking = model._chunkings.get(ns)
        waiting = frozenset(res[p].fid for p in pending if res[p].ns == ns)
        build = functools.partial(_build, ns, chunking, blob, count, nbytes, waiting,
                                  paths, nss, fids)
        model._spaces[ns] = DeferredNamespace(build, nbytes, chunking, waiting, blob, stranded,
                                              model._snapshot_damaged)
    model._res = res
    model._by_rid = by_rid
    model._pending = set(pending)
    model._recorded_budget = budget
    model._clock = clock
    model._offset = length
    model._deferring = True
    if skipped:
        model.counters.add(journal_records_skipped=skipped)
    return "used"


def _build(ns: str, chunking: Chunking | None, blob: bytes, count: int, nbytes: int,
           waiting: frozenset[int], paths: list[str], nss: list[str],
           fids: list[int]) -> Namespace:
    """Namespace ``ns`` of a loaded snapshot, built from its part of the payload (``blob``)
    and the reservations (its files' paths), every field checked against them: ``count``
    files of ``nbytes`` bytes, those of ``waiting`` not written.  Damaged: one does not
    hold (only a payload forged with its digest can: the digest was checked at the load)."""
    from vllm_adapter.disk.ledger_model import Namespace

    collecting = gc.isenabled()
    gc.disable()  # millions of containers, none garbage: no collection pass over them
    try:
        state = marshal.loads(blob)
        _check(type(state) is tuple and len(state) == 3)
        structure_state, disk_state, order = state
        structure = PrefixStructure(chunking)
        _fill_structure(structure, structure_state)
        disk = Disk(structure)
        _fill_disk(disk, disk_state)
        named = {f: p for p, n, f in zip(paths, nss, fids, strict=True) if n == ns}
        _check(len(named) == count == len(_counts(order)) and named.keys() == disk.files.keys()
               and disk.bytes == nbytes
               and all(f.ready is (fid not in waiting) for fid, f in disk.files.items()))
        path_of = {fid: named[fid] for fid in order}
        _check(len(path_of) == count)
    except Damaged:
        raise
    except (ValueError, TypeError, EOFError, KeyError, IndexError, AttributeError,
            OverflowError) as e:
        raise Damaged(f"the ledger snapshot's namespace {ns!r}: {e!r}") from e
    finally:
        if collecting:
            gc.enable()
    return Namespace(structure, disk, path_of)


def _fill_structure(s: PrefixStructure, state: Any) -> None:
    _check(type(state) is tuple and len(state) == 9)
    parents, parent_of, heads, children, bounds, full, windows, served, serves = state
    _of(parents, bytes)
    _of(parent_of, bytes, type(None))
    _of(heads, bytes)
    _keys(children, set)
    _of(bounds, bytes)
    _keys(full, tuple)
    _keys(windows, frozenset)
    _of(served, bytes)
    _keys(serves, list)
    s.parent = dict(zip(parents, parent_of, strict=True))
    s.children = dict(zip(heads, children, strict=True))
    s.full_at = dict(zip(bounds, full, strict=True))
    s.windows_at = dict(zip(bounds, windows, strict=True))
    s.serves = dict(zip(served, serves, strict=True))
    _check(len(s.parent) == len(parents) and len(s.children) == len(heads)
           and len(s.full_at) == len(bounds) and len(s.serves) == len(served))


def _fill_disk(disk: Disk, state: Any) -> None:
    _check(type(state) is tuple and len(state) == 14)
    (fids, keys, nbytes, last_use, ready, pins, held, holder, scalars, dep_fids, dep_counts,
     leaves, recency, windows_only) = state
    _counts(fids)
    _keys(keys, tuple)
    _counts(nbytes)
    _of(last_use, int)
    _of(ready, bool)
    _counts(pins)
    _of(held, bytes)
    _counts(holder)
    _check(type(scalars) is tuple and len(scalars) == 4 and set(map(type, scalars)) <= {int})
    _counts(dep_fids)
    _of(dep_counts, int)
    _flat(_of(leaves, tuple), int)
    _check(all(len(e) == 3 for e in leaves))
    _counts(recency)
    _counts(windows_only)
    _check(len(fids) == len(keys) == len(nbytes) == len(last_use) == len(ready) == len(pins))
    files = dict(zip(fids, map(Disk.file_record, keys, nbytes, last_use, ready, pins),
                     strict=True))
    total = scalars[0]
    _check(len(files) == len(fids) and total == sum(nbytes)
           and set(holder) <= files.keys() and len(held) == len(holder)
           and set(recency) == files.keys() == set(dep_fids) and len(recency) == len(files)
           and set(windows_only) <= files.keys())
    disk.files = files
    disk.file_of = dict(zip(held, holder, strict=True))
    _check(len(disk.file_of) == len(held))
    disk.bytes, disk.peak_bytes, disk.clock, next_id = scalars
    disk.restore_bookkeeping((next_id, dict(zip(dep_fids, dep_counts, strict=True)), leaves,
                              recency, windows_only))


# -- a replay of its own --------------------------------------------------------


def replay(ledger_path: str, journal: bytes, chunkings: Mapping[str, Chunking], *,
           snapshot: bool = True) -> LedgerModel:
    """A fresh replay of the journal's bytes ``journal`` (from the current snapshot and the
    tail when it binds; ``snapshot`` False: every line), the model a snapshot is written
    from: no lease, no lock of its own (the caller holds the root's), nothing this engine
    observed itself."""
    from vllm_adapter.disk.ledger_model import BudgetCounters, LedgerIO, LedgerModel

    model = LedgerModel()
    model.root = os.path.dirname(ledger_path)
    model.rule = EvictionRule.REACHABLE  # a replay reads no rule
    model.counters = BudgetCounters()
    model.io = LedgerIO()
    model.ledger_path = ledger_path
    model._thread_lock = threading.RLock()
    model._chunkings = dict(chunkings)
    model._kept = {}
    model._compacted_bytes = 0
    model._use_snapshot = snapshot
    model._reset()
    model._replay_whole(journal)
    return model
