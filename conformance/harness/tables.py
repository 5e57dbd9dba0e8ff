"""Worked-example tables for docs/semantics.md, computed by the reference.

``python -m conformance.harness.tables`` prints, for gemma-4-31B-it TP2 and
DeepSeek-V4-Flash TP4 under ``{"block_size": 512}``, per group: tokens per
chunk, the window in chunks, and which chunks a 5000-token prompt stores and
which a repeat of it reloads (sim engine, one prefill step, retention 0).
"""

from __future__ import annotations

from dataclasses import replace

from conformance.harness.sim import SimEngine
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import split_key
from reference.knobs import BlockSize, resolve
from reference.plan import Policy
from vllm_adapter.render import render_table

COLUMNS = (
    "group", "kind", "tokens/block", "blocks/chunk", "tokens/chunk", "window (chunks)",
    "indices of chunks stored", "indices of chunks reloaded",
)
GEMMA4_TP2 = Geometry(
    tuple(KVGroup(i, GroupKind.SLIDING_WINDOW, 16, sliding_window=1024) for i in range(5))
    + (KVGroup(5, GroupKind.FULL, 32),),
    tokens_per_hash=16,
    name="gemma-4-31B-it TP2",
)
DSV4_TP4 = Geometry(
    (
        KVGroup(0, GroupKind.SLIDING_WINDOW, 64, sliding_window=128),
        KVGroup(1, GroupKind.SLIDING_WINDOW, 64, sliding_window=128),
        KVGroup(2, GroupKind.FULL, 256),
        KVGroup(3, GroupKind.SLIDING_WINDOW, 4, sliding_window=8),
        KVGroup(4, GroupKind.SLIDING_WINDOW, 8, sliding_window=128),
    ),
    tokens_per_hash=4,
    name="DeepSeek-V4-Flash TP4",
)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "-"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def table(geometry: Geometry, tokens: int = 5000, block_size: int = 512) -> str:
    small = replace(geometry, groups=tuple(replace(g, page_bytes=8, num_layers=1) for g in geometry.groups))
    chunking = resolve(small, BlockSize(block_size))
    sim = SimEngine(chunking, num_slots=4096, policy=Policy(), blocks_per_group=8192)
    stored: dict[int, list[int]] = {gc.group.index: [] for gc in chunking.groups}
    original = sim.planner.step

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        jobs = original(*args, **kwargs)
        for _, job in jobs:
            for key in job.keys:
                stored[split_key(key)[1]].append(key)  # type: ignore[arg-type]
        return jobs

    sim.planner.step = spy  # type: ignore[method-assign]
    prompt = list(range(tokens))
    sim.run_request("a", prompt, tokens)
    req = sim.run_request("b", prompt, tokens)
    from reference.keys import group_keys, prefix_block_hashes

    hashes = prefix_block_hashes(prompt, chunking.tokens_per_hash)
    loaded = set(req.loaded.keys) if req.loaded else set()
    hit = req.loaded.hit_tokens if req.loaded else 0
    rows = []
    for gc in chunking.groups:
        keys = group_keys(hashes, gc)
        s = sorted(keys.index(k) for k in stored[gc.group.index])  # type: ignore[arg-type]
        r = sorted(i for i, k in enumerate(keys) if k in loaded)
        g = gc.group
        kind = g.kind.value + (f" {g.sliding_window}" if g.sliding_window else "")
        window = gc.window_in_chunks if gc.window_in_chunks is not None else "-"
        rows.append((g.index, kind, g.tokens_per_block, gc.blocks_per_chunk, gc.tokens_per_chunk,
                     window, _ranges(s), _ranges(r)))
    return (
        f"**{geometry.name}**, `block_size: {block_size}`, {tokens}-token prompt: "
        f"reload hit = {hit} tokens.\n\n" + render_table(COLUMNS, rows, "markdown")
    )


if __name__ == "__main__":
    print(table(GEMMA4_TP2))
    print()
    print(table(DSV4_TP4))
