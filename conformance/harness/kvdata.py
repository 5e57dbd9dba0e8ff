"""A synthetic model runner: deterministic KV bytes through vLLM's real worker path.

:class:`SyntheticModelRunner` owns the worker's paged KV cache and plays the
GPU model runner's part for :class:`conformance.harness.driver.DriverSession`
(``session(model_runner=...)``):

* **Allocation** as the runner would for the worker-view ``KVCacheConfig``:
  with ``kv_cache_tensors`` (real fixtures) through vLLM's own
  ``allocate_kv_cache`` (one backing buffer, layers placed at ``offset + l *
  layer_stride + b * block_stride``; cache groups overlay each other); without
  them (the driver's hand-made configs) one ``uint8 [num_blocks, page]``
  tensor per layer.  ``kv_caches`` is what ``register_kv_caches`` gets, so vLLM
  builds its canonical tensors from it.
* **The forward pass** (``execute_model``, after ``start_load_kv``): for every
  scheduled request and every KV-cache group, each block touched by the tokens
  computed this step gets, in every layer of the group, the bytes
  :func:`~conformance.harness.kv_pattern.expected_bytes` ``(layer, i,
  H(tokens[:min((i + 1) * tpb, computed)]))`` where ``i`` is the block's
  position in the request (the pattern and why it tells blocks apart:
  :mod:`conformance.harness.kv_pattern`).  Mamba groups (one state, not
  per-token KV) write only the block holding the last computed token.
* **Load checks** (``before_start_load_kv`` / ``execute_model``): before the
  step's loads run, every destination block of every load job is poisoned in
  every layer of its group (so a load that writes nothing cannot pass), and the
  whole KV memory is snapshotted.  After them, each loaded block must hold the
  expected bytes of its position in the loading request, in every layer of its
  group, and no byte outside the loaded rows of the canonical tensors may have
  changed.  Results accumulate in :attr:`SyntheticModelRunner.stats`
  (:class:`~conformance.harness.kv_stats.DataStats`).

Only the bytes ``[0, unpadded page)`` of each layer's block are written and
checked; padding is vLLM's and is never compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.harness import vllm_harness_api as V
from conformance.harness.kv_memory import LayerPages, flat_bytes, layer_specs, unpadded_page_bytes
from conformance.harness.kv_pattern import prefix_hashes
from conformance.harness.kv_stats import DataStats

__all__ = ["SyntheticModelRunner"]

_POISON_BYTE = 0xA5


class SyntheticModelRunner:
    """The worker's KV memory plus deterministic writes and load checks (see the module doc).

    ``kv_cache_config`` is the worker view (for DeepSeek-V4 the one with
    ``UniformTypeKVCacheSpecs``); ``vllm_config`` supplies the KV-cache layout
    when the config has ``kv_cache_tensors``.
    """

    max_failures = 8

    def __init__(
        self,
        kv_cache_config: Any,
        vllm_config: Any | None = None,
        *,
        device: torch.device | str = "cpu",
        check_loads: bool = True,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.check_loads = check_loads
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.stats = DataStats()
        self.offloaded_group_ids = tuple(V.get_offloading_group_ids(kv_cache_config))
        self.stats.offloaded_group_ids = self.offloaded_group_ids
        self.layers: dict[str, LayerPages] = {}
        self._padded_groups: dict[int, int] = {}
        """Group id -> its real page bytes, for own (not planned) layers with padded pages."""
        self.group_layers: dict[int, list[LayerPages]] = {}
        if kv_cache_config.kv_cache_tensors:
            if vllm_config is None:
                raise ValueError(
                    "a KVCacheConfig with kv_cache_tensors needs the vllm_config (layout)"
                )
            layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
            self.kv_caches: dict[str, torch.Tensor] = V.allocate_kv_cache(
                kv_cache_config, self.device, layout
            )
            self._place_planned_layers()
        else:
            self.kv_caches = {}
            self._place_own_layers()
        storages: dict[int, Any] = {}
        for t in self.kv_caches.values():
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        self._storages = list(storages.values())
        self._hashes: dict[str, tuple[list[int], list[int]]] = {}
        self._snapshots: list[torch.Tensor] | None = None

    # -- allocation ----------------------------------------------------------

    def _add_layer(self, name: str, group_id: int, spec: Any, pages: torch.Tensor) -> None:
        layer = LayerPages(
            name=name,
            group_id=group_id,
            tokens_per_block=int(spec.block_size),
            is_mamba=isinstance(spec, V.MambaSpec),
            nbytes=int(pages.shape[1]),
            pages=pages,
        )
        self.layers[name] = layer
        self.group_layers.setdefault(group_id, []).append(layer)

    def _place_own_layers(self) -> None:
        """Hand-made configs: one ``uint8 [num_blocks, page]`` tensor per layer."""
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            for name, spec in layer_specs(group).items():
                tensor = torch.zeros(
                    (self.num_blocks, int(spec.page_size_bytes)),
                    dtype=torch.uint8,
                    device=self.device,
                )
                nbytes = unpadded_page_bytes(spec)
                if nbytes < int(spec.page_size_bytes):
                    self._padded_groups[gid] = max(nbytes, self._padded_groups.get(gid, 0))
                # Padding holds per-block junk: a load that copies it changes foreign bytes.
                pad = tensor[:, nbytes:]
                pad.copy_(torch.arange(pad.numel(), device=self.device).view(pad.shape) % 251)
                self.kv_caches[name] = tensor
                self._add_layer(name, gid, spec, tensor[:, :nbytes])

    def _place_planned_layers(self) -> None:
        """Layers where ``KVCacheTensor`` puts them: ``offset + l*layer_stride + b*block_stride``."""
        specs: dict[str, tuple[int, Any]] = {}
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            for name, spec in layer_specs(group).items():
                specs[name] = (gid, spec)
        for kvt in self.kv_cache_config.kv_cache_tensors:
            buf = flat_bytes(self.kv_caches[kvt.layers[0]].untyped_storage(), self.device)
            for index, name in enumerate(kvt.layers):
                gid, spec = specs[name]
                nbytes = unpadded_page_bytes(spec)
                pages = buf.as_strided(
                    (self.num_blocks, nbytes),
                    (kvt.block_stride, 1),
                    kvt.offset + index * kvt.layer_stride,
                )
                self._add_layer(name, gid, spec, pages)
        missing = sorted(set(specs) - set(self.layers))
        if missing:
            raise ValueError(f"layers without a KVCacheTensor: {missing[:5]}")

    # -- contents ------------------------------------------------------------

    def hashes(self, req_id: str, tokens: Sequence[int]) -> list[int]:
        """Prefix hashes of (at least) ``tokens``, a request's tokens; cached per request.

        ``out[k]`` hashes ``tokens[:k]``; the cache grows as tokens arrive and
        is dropped when ``req_id`` turns out to name other tokens.
        """
        tokens = list(tokens)
        seen, have = self._hashes.get(req_id, ([], [0]))
        n = min(len(seen), len(tokens))
        if seen[:n] != tokens[:n]:
            seen, have = [], [0]
        if len(tokens) > len(seen):
            have = prefix_hashes(tokens, have)
            seen = tokens
        self._hashes[req_id] = (seen, have)
        return have

    def _write(
        self, layer: LayerPages, block_ids: list[int], positions: list[int], hashes: list[int]
    ) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        layer.data.index_copy_(0, ids, layer.rows(positions, hashes))

    def write_request(
        self,
        req_id: str,
        tokens: Sequence[int],
        table: Sequence[Sequence[int]],
        start: int,
        stop: int,
    ) -> None:
        """The forward pass of one request over tokens ``[start, stop)``."""
        if stop <= start:
            return
        hashes = self.hashes(req_id, tokens[:stop])
        for gid, layers in self.group_layers.items():
            ids = table[gid]
            tpb = layers[0].tokens_per_block
            if layers[0].is_mamba:
                positions = [(stop - 1) // tpb]
            else:
                positions = list(range(start // tpb, (stop - 1) // tpb + 1))
            chosen = [(ids[i], i) for i in positions if i < len(ids) and ids[i] != 0]
            if not chosen:
                continue
            block_ids = [b for b, _ in chosen]
            pos = [i for _, i in chosen]
            hs = [hashes[min((i + 1) * tpb, stop)] for i in pos]
            for layer in layers:
                self._write(layer, block_ids, pos, hs)
            self.stats.blocks_written += len(block_ids)

    # -- driver hooks --------------------------------------------------------

    def before_start_load_kv(self, session: Any, so: Any) -> None:
        self.stats.steps += 1
        load_jobs = so.kv_connector_metadata.load_jobs
        if not self.check_loads or not load_jobs:
            self._snapshots = None
            return
        for tj in load_jobs.values():
            for gid, block_ids, _ in self._job_blocks(tj.dst_spec):
                idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
                for layer in self.group_layers.get(gid, ()):
                    layer.pages.index_fill_(0, idx, _POISON_BYTE)
        self._snapshots = [flat_bytes(s, self.device).clone() for s in self._storages]

    def execute_model(self, session: Any, so: Any) -> None:
        if self._snapshots is not None:
            self._check_loads(session, so)
            self._snapshots = None
        for req_id, n in so.num_scheduled_tokens.items():
            req = session.scheduler.requests[req_id]
            stop = int(req.num_computed_tokens)
            self.write_request(
                req_id, req.all_token_ids, session.block_ids(req_id), stop - int(n), stop
            )

    # -- checks --------------------------------------------------------------

    def _job_blocks(self, gpu_spec: Any) -> list[tuple[int, list[int], list[int]]]:
        """``(group id, block ids, positions)`` per offloaded group a GPU spec lists."""
        out = []
        cursor = 0
        ids = [int(b) for b in gpu_spec.block_ids]
        for pos, (n, first) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            n, first = int(n), int(first)
            if n:
                gid = self.offloaded_group_ids[pos]
                out.append((gid, ids[cursor : cursor + n], list(range(first, first + n))))
            cursor += n
        return out

    @staticmethod
    def _blocks_per_chunk(session: Any) -> int:
        """The offloading spec's ``blocks_per_chunk`` (0 when the worker connector has none)."""
        spec = getattr(session.worker_connector.connector_worker, "spec", None)
        return int(getattr(spec, "blocks_per_chunk", 0) or 0)

    def _chunks(self, tj: Any, bpc: int) -> dict[int, tuple[int, list[int]]]:
        """Group id -> (the request's chunk index of the job's first block in that group, the
        CPU chunk ids the job's ``src_spec`` lists for that group, in order); empty when the
        spec's chunks do not add up (then failures name positions only)."""
        ids = [int(c) for c in getattr(tj.src_spec, "block_ids", ())]
        out: dict[int, tuple[int, list[int]]] = {}
        cursor = 0
        if bpc <= 0:
            return out
        for gid, _, positions in self._job_blocks(tj.dst_spec):
            lo, hi = positions[0] // bpc, positions[-1] // bpc
            out[gid] = (lo, ids[cursor : cursor + hi - lo + 1])
            cursor += hi - lo + 1
        return out if cursor == len(ids) else {}

    def _where(self, chunks: dict[int, tuple[int, list[int]]], gid: int, position: int,
               bpc: int) -> str:
        """``request chunk <index> (CPU chunk <id>), `` of a block, when known."""
        if gid not in chunks or bpc <= 0:
            return ""
        first, ids = chunks[gid]
        k = position // bpc - first
        cpu = f" (CPU chunk {ids[k]})" if 0 <= k < len(ids) else ""
        return f"request chunk {position // bpc}{cpu}, "

    def _whose(
        self, layer: LayerPages, block_id: int, positions: list[int], hashes: list[int]
    ) -> str:
        """`` (those of block index j)`` when the block holds another loaded position's bytes."""
        row = layer.data[block_id]
        for j, h in zip(positions, hashes, strict=True):
            if torch.equal(row, layer.rows([j], [h])[0]):
                return f" (those of block index {j})"
        return ""

    def _fail(self, text: str) -> None:
        if len(self.stats.failures) < self.max_failures:
            self.stats.failures.append(text)

    def _check_loads(self, session: Any, so: Any) -> None:
        worker = session.worker_connector.connector_worker.worker
        snapshots = self._snapshots or []
        storage_index = {s.data_ptr(): k for k, s in enumerate(self._storages)}
        for job_id, tj in so.kv_connector_metadata.load_jobs.items():
            self.stats.load_jobs += 1
            tokens = session.scheduler.requests[tj.req_id].all_token_ids
            hashes = self.hashes(tj.req_id, tokens)
            bpc = self._blocks_per_chunk(session)
            chunks = self._chunks(tj, bpc)
            for gid, block_ids, positions in self._job_blocks(tj.dst_spec):
                self.stats.loaded_blocks_checked += len(block_ids)
                per_group = self.stats.checked_per_group
                per_group[gid] = per_group.get(gid, 0) + len(block_ids)
                layers = self.group_layers[gid]
                tpb = layers[0].tokens_per_block
                ends = [(i + 1) * tpb for i in positions]
                idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
                # The load may write these rows: make the snapshot agree there.
                self._forgive(worker, gid, idx, snapshots, storage_index)
                if ends[-1] > len(tokens):
                    self.stats.corrupted_loads += len(block_ids)
                    self._fail(
                        f"job {job_id} ({tj.req_id}) loads group {gid} block position "
                        f"{positions[-1]}, past the request's {len(tokens)} tokens"
                    )
                    continue
                hs = [hashes[e] for e in ends]
                bad = torch.zeros(len(block_ids), dtype=torch.bool, device=self.device)
                for layer in layers:
                    wrong = (layer.data.index_select(0, idx) != layer.rows(positions, hs)).any(
                        dim=1
                    )
                    if bool(wrong.any()):
                        k = int(wrong.nonzero()[0])
                        where = self._where(chunks, gid, positions[k], bpc)
                        self._fail(
                            f"job {job_id} ({tj.req_id}) {where}group {gid} layer {layer.name}: "
                            f"GPU block {block_ids[k]} at block index {positions[k]} "
                            f"holds wrong bytes{self._whose(layer, block_ids[k], positions, hs)}"
                        )
                    bad |= wrong
                self.stats.corrupted_loads += int(bad.sum())
        for before, storage in zip(snapshots, self._storages, strict=True):
            after = flat_bytes(storage, self.device)
            if torch.equal(before, after):
                continue
            changed = (before != after).nonzero()
            self.stats.foreign_bytes_changed += int(changed.numel())
            self._fail(
                f"{changed.numel()} bytes outside the loaded blocks changed "
                f"(first at byte {int(changed[0])} of a {after.numel()}-byte KV buffer)"
            )

    def _forgive(
        self,
        worker: Any,
        gid: int,
        idx: torch.Tensor,
        snapshots: list[torch.Tensor],
        storage_index: dict[int, int],
    ) -> None:
        """Copy the bytes a load of these blocks may write from the live memory into the snapshot.

        Those are the group's canonical rows -- bytes ``[0, nbytes)`` of row
        ``b`` of every canonical tensor the group refers to -- taken from the
        reference worker's layout; with any other worker, the group's layer pages.
        """
        layout = getattr(worker, "layout", None)
        tensors = getattr(worker, "gpu_tensors", None)
        if layout is not None and tensors is not None:
            group = self.offloaded_group_ids.index(gid)
            # Own padded layers: capped at the real page, so copied padding is not forgiven.
            real = self._padded_groups.get(gid)
            views = [(tensors[r.tensor_index], r.nbytes if real is None else min(r.nbytes, real))
                     for r in layout.group_refs[group]]
        else:
            views = [(layer.pages, layer.nbytes) for layer in self.group_layers[gid]]
        for view, nbytes in views:
            k = storage_index[view.untyped_storage().data_ptr()]
            shape, stride = (view.shape[0], nbytes), (view.stride(0), 1)
            offset = view.storage_offset()
            live = flat_bytes(view.untyped_storage(), self.device).as_strided(
                shape, stride, offset
            )
            kept = snapshots[k].as_strided(shape, stride, offset)
            kept.index_copy_(0, idx, live.index_select(0, idx))
