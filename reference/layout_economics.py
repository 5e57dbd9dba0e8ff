"""Per-layout file tallies: the files, sections, opens and reads a disk layout gives.

The packed layout (:data:`PACKED`) is a tier that writes one or two files per store
job, its full-attention keys in one and its window keys in the other
(:func:`reference.packed.store_job_files`), each key a section in job order (a file with
no new key is not written), counted from the Planner's own store and load jobs
(:class:`reference.economics.Engine` feeds them to :class:`_PackedFiles`): files and sections written; per load job, the files it
opens (distinct files among its keys), the sections it reads and its reads (maximal
runs of adjacent sections of one file); a load job large enough to split across the tier's
pool (:class:`PackedLoads`) opens a file once per slice that touches it and reads each
run within a slice (:func:`reference.packed_split.load_slices`, the tier's rule).  The same counts for one file per *request*
(:data:`PACKED_PER_REQUEST`, all its stored keys) are kept as the alternative unit.
Today's layout, one file per key (:data:`PER_CHUNK`), is stated in the same terms
(:class:`LayoutEconomics`) from the per-group counts
(:attr:`reference.economics.Economics.per_chunk`).

A pass's counters are a :class:`LayoutTally`; :func:`layout_economics` turns one into a
:class:`LayoutEconomics` (totals; bytes given the section size per group).  Nothing here
imports :mod:`reference.economics`: its engine uses these tallies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reference.keys import split_key
from reference.packed import packed_file_bytes, page_round
from reference.packed_split import LoadSplit, load_counts, load_slices

__all__ = [
    "PACKED",
    "PACKED_PER_REQUEST",
    "PER_CHUNK",
    "LayoutEconomics",
    "LayoutTally",
    "Open",
    "PackedLoads",
    "Sections",
    "layout_economics",
]

Sections = tuple[tuple[int, int], ...]
"""``(group index, key bytes)`` of each section of a file (or of one open's sections), sorted."""
Open = tuple[Sections, Sections]
"""One file open of a load job: the sections it reads, and all the file's sections (its
header indexes them all; the tier's index holds it, so a load does not read it)."""


PER_CHUNK = "per_chunk"
PACKED = "packed"
PACKED_PER_REQUEST = "packed_per_request"


@dataclass(frozen=True)
class LayoutEconomics:
    """One disk layout's files, sections, opens and reads for a pass (totals).

    A *file* is what the tier creates (per chunk: one key; packed: one store job's
    full-attention keys, or its window keys); an *open* is a file a load job reads from (per load job, the distinct
    files among its keys; per slice of a load job split across the pool,
    :func:`reference.packed_split.load_slices`); a *read* is one maximal run of adjacent
    sections of one file that a load job (or a slice of one) asks for
    (:func:`reference.packed.read_runs`).  ``*_once``:
    only keys not loaded before in the pass (a CPU tier that keeps what it
    promoted); the others count every load.  Bytes need the section (CPU-tier row)
    size per group: :meth:`written_sizes`, :meth:`opened_sizes`.
    """

    layout: str
    """:data:`PER_CHUNK`, :data:`PACKED` (one or two files per store job) or
    :data:`PACKED_PER_REQUEST` (one file per request)."""
    files: tuple[tuple[Sections, int], ...]
    """Each file's sections, and how many files have them."""
    opened: tuple[tuple[Open, int], ...]
    """What each open reads, and how many opens read it (every load)."""
    opened_once: tuple[tuple[Open, int], ...]
    reads: int
    reads_once: int
    jobs_written: int = 0
    """Store jobs that wrote at least one file (a job's files share one ledger reservation
    and one completion)."""

    @property
    def files_written(self) -> int:
        return sum(n for _, n in self.files)

    @property
    def sections_written(self) -> int:
        return sum(len(s) * n for s, n in self.files)

    @property
    def file_opens(self) -> int:
        return sum(n for _, n in self.opened)

    @property
    def file_opens_once(self) -> int:
        return sum(n for _, n in self.opened_once)

    @property
    def sections_read(self) -> int:
        return sum(len(s) * n for (s, _), n in self.opened)

    @property
    def sections_read_once(self) -> int:
        return sum(len(s) * n for (s, _), n in self.opened_once)

    def file_size(self, sections: Sections, section_bytes: Mapping[int, int]) -> int:
        """A file's bytes: one CPU-tier row per chunk; packed: :func:`packed_file_bytes`."""
        if self.layout == PER_CHUNK:
            return sum(section_bytes[g] for g, _ in sections)
        return packed_file_bytes([section_bytes[g] for g, _ in sections], [k for _, k in sections])

    def read_size(self, opened: Open, section_bytes: Mapping[int, int]) -> int:
        """Bytes one open reads: the whole file per chunk; packed: the page-rounded
        sections it wants, and no header (the tier's index keeps each file's identity and
        sections, so a load checks the file with one ``fstat`` and reads its sections
        only)."""
        sections, _ = opened
        if self.layout == PER_CHUNK:
            return sum(section_bytes[g] for g, _ in sections)
        return sum(page_round(section_bytes[g]) for g, _ in sections)

    def written_sizes(self, section_bytes: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
        """``(file bytes, files)``, each file with its own bytes."""
        return _histogram((self.file_size(s, section_bytes), n) for s, n in self.files)

    def opened_sizes(
        self, section_bytes: Mapping[int, int], *, once: bool = False
    ) -> tuple[tuple[int, int], ...]:
        """``(bytes read, opens)``, each open with its own bytes (``once``: read-once)."""
        opened = self.opened_once if once else self.opened
        return _histogram((self.read_size(s, section_bytes), n) for s, n in opened)

    def bytes_written(self, section_bytes: Mapping[int, int]) -> int:
        return sum(size * n for size, n in self.written_sizes(section_bytes))

    def bytes_read(self, section_bytes: Mapping[int, int], *, once: bool = False) -> int:
        return sum(size * n for size, n in self.opened_sizes(section_bytes, once=once))


def _histogram(pairs: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: Counter[int] = Counter()
    for size, n in pairs:
        out[size] += n
    return tuple(sorted(out.items()))


@dataclass
class LayoutTally:
    """One pass's counters for a packed layout (section groups per file and per open)."""

    files: Counter[Sections] = field(default_factory=Counter)
    opened: Counter[Open] = field(default_factory=Counter)
    opened_once: Counter[Open] = field(default_factory=Counter)
    reads: int = 0
    reads_once: int = 0
    jobs: int = 0
    """Store jobs that wrote at least one file."""


@dataclass(frozen=True)
class PackedLoads:
    """How a packed tier splits its load jobs (:func:`reference.packed_split.load_slices`):
    its split rule and each group's section (CPU-tier row) bytes."""

    split: LoadSplit
    section_bytes: Mapping[int, int]


class _PackedFiles:
    """Where each stored key lives in a packed layout: key -> (file, section position).

    Kept across passes (the files stay on disk); the counts go to a :class:`LayoutTally`.
    ``loads``: how load jobs are split (None: every load job is one task).
    """

    def __init__(self, loads: PackedLoads | None = None) -> None:
        self.loads = loads
        self.at: dict[bytes, tuple[int, int]] = {}
        self.sections: list[Sections] = []
        """Each file's sections (file id = its place here)."""

    def write(self, keys: Iterable[bytes], tally: LayoutTally) -> bool:
        """One file whose sections are ``keys`` not already on disk, in order (none: no
        file); whether it was written."""
        new = [k for k in dict.fromkeys(keys) if k not in self.at]
        if not new:
            return False
        for position, key in enumerate(new):
            self.at[key] = (len(self.sections), position)
        self.sections.append(_sections(new))
        tally.files[self.sections[-1]] += 1
        return True

    def read(self, keys: Sequence[bytes], tally: LayoutTally, once: Iterable[bytes]) -> None:
        """One load job of ``keys``; ``once``: those not loaded before in the pass."""
        tally.reads += self._opens(keys, tally.opened)
        tally.reads_once += self._opens(list(once), tally.opened_once)

    def _opens(self, keys: Sequence[bytes], opened: Counter[Open]) -> int:
        """Count the opens of one load job of ``keys`` (one per file per slice that touches
        it, :func:`reference.packed_split.load_slices`); return its reads (runs of adjacent
        sections within a slice)."""
        wanted: dict[bytes, tuple[int, int, int]] = {}
        sizes = {} if self.loads is None else self.loads.section_bytes
        for key in keys:
            if key not in self.at:
                raise ValueError(f"load of a key no packed file holds: {key.hex()}")
            file_id, position = self.at[key]
            wanted[key] = (file_id, position, sizes.get(split_key(key)[1], 0))
        key_at = {(f, p): k for k, (f, p, _) in wanted.items()}
        slices = load_slices(wanted.values(), None if self.loads is None else self.loads.split)
        for part in slices:
            for f, positions in part:
                opened[(_sections(key_at[(f, p)] for p in positions), self.sections[f])] += 1
        return load_counts(slices)[1]


def _sections(keys: Iterable[bytes]) -> Sections:
    return tuple(sorted((split_key(k)[1], len(k)) for k in keys))


def layout_economics(layout: str, tally: LayoutTally) -> LayoutEconomics:
    """A packed layout's :class:`LayoutEconomics` from one pass's :class:`LayoutTally`."""
    return LayoutEconomics(
        layout, tuple(sorted(tally.files.items())), tuple(sorted(tally.opened.items())),
        tuple(sorted(tally.opened_once.items())), tally.reads, tally.reads_once, tally.jobs,
    )
