"""kvchunk's disk tier: vLLM's fs tier whose files are checksummed, namespaced, packed and budgeted.

Serve it with ``"spec_name": "KvchunkTieringOffloadingSpec", "spec_module_path":
"vllm_adapter.disk"`` (the old path ``vllm_adapter.safe_fs`` still works for one
release, with a ``DeprecationWarning``).

**The cut: one module per concern, layered so each imports only the ones below it.**

=====================  ===============================================================  ==========
module                 concern                                                          imports vLLM
=====================  ===============================================================  ==========
``tier``               the vLLM glue: ``KvchunkFileTierManager`` (vLLM's                yes
                       ``FileSystemTierManager`` with kvchunk's I/O and budget) and
                       ``KvchunkTieringOffloadingSpec``, and nothing else
``metrics``            the counters and gauges the tier reports to vLLM's stats         yes
``fileio``             the tier's file I/O as one object                                no
                       (:class:`~.fileio.TierFileIO`); the tier calls files only
                       through it, so a test wraps the object, never module globals
``options``            the tier entry's keys, their errors, the geometry namespace      no
``chunk_file``         the per-chunk file format and its I/O (header, checksum)         no
``atomic_file``        a whole file written atomically (temporary name, rename) and     no
                       the sweep of a dead writer's temporary files
``quarantine``         a bad file's end: deleted, or quarantined within a byte cap      no
``packed_header``      the packed file's header: its bytes, checks and identity         no
``packed_file``        the packed file (:mod:`reference.packed`'s layout): store, load  no
``packed_io``          the packed index and a job's packed reads and writes             no
``packed_split``       packed store and load jobs split across the tier's I/O pool      no
``packed_snapshot``    the packed index's snapshot (a start without reading headers)    no
``budget``             ``disk_bytes_to_use`` and ``eviction``: parsing, the reference   no
                       chunking the ledger judges prefixes with
``tier_budget``        one tier's view of its root's ledger (absolute paths, vLLM's     no
                       ``ReqContext``)
``finished``           when a request's stores can strand nothing more: its store       no
                       tasks done and vLLM finished it (its stranded keys then leave)
``ledger``             the root ledger's operations under the root's lock: reserve,     no
                       evict, complete, reclaim dead owners, start, compact
``ledger_model``       the model every engine on a root shares, kept equal to the       no
                       journal (replay, apply, append)
``ledger_snapshot``    the ledger model's snapshot (a start without replaying the       no
                       journal)
``journal``            the ledger's records and their codec                             no
``lease``              owners' leases (flock on one kernel, heartbeats across hosts)    no
                       and the root's lock across hosts (the held symlink)
``counters``           the thread-safe counter base                                     no
=====================  ===============================================================  ==========

Why this cut: the three things a maintainer changes independently are the file formats
(``chunk_file``, ``packed_header``, ``packed_file``), the budget (``budget``, ``tier_budget``,
``ledger``, ``ledger_model``, ``journal``, ``lease``) and the vLLM glue (``tier``, ``metrics``); only
``tier`` and ``metrics`` import vLLM, so the formats and the ledger are tested without an engine.  The eviction
rule itself is :mod:`reference.eviction`'s, reached through its public interface only.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvchunkFileTierManager", "KvchunkTieringOffloadingSpec"]


def __getattr__(name: str) -> Any:
    # The vLLM glue loads on first use: the formats and the ledger import without vLLM,
    # and vLLM's spec factory (importlib + getattr) still finds the spec here.
    if name in __all__:
        from vllm_adapter.disk import tier

        return getattr(tier, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
