"""Why the eviction rule serves fewer hits than plain LRU on a small disk (issue #31, item 2).

At the second point of ``--sweep-disk`` (a quarter of the unbounded run's peak bytes) of the
agentic workload, ``block_size`` 512, gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4, serve the
scaled workload (:func:`reference.disk_economics.scaled`, GPU cache cold, no CPU tier, as
``--sweep-disk`` does) over a :class:`reference.disk_economics.BudgetedIndex` for each of

* eviction {the rule (leaves first), plain LRU} x admission {on, off} x a store that does not
  fit {refused whole, the longest prefix-closed head admitted} (the index's options);
* two cause checks, both rules: the packed layout with each store's window keys in a file of
  their own (``windows_apart``), and one file per key (``per_chunk``);

and one experiment (not a reference option): the rule with windows apart, evicting first the
window files of boundaries its prefix goes on past (:class:`InteriorWindowsFirst`);

and print, per variant: the hit rate, stores refused, keys dropped by admission, stores cut
to a head, tokens recomputed for lack of space (per million prompt tokens), bytes stranded
and on disk at the end, the share of the disk that is window sections in files the rule may
not evict (non-leaves; mean over the requests served with the disk over 90 % full), and the
prompt tokens served from full-attention keys that had been stranded after an earlier
request (plain LRU's files reconnected when a later turn stores again only the missing head).

Run (vLLM 0.34.0's environment: the CLI derives each model's chunking and key sizes)::

    KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 .nox/tests-vllm-0-34-0/bin/python scripts/disk_ablation.py

``--point N`` picks another curve point (1-8), ``--workload chat`` another workload,
``--model gemma`` or ``--model dsv4`` one model.  ``--curves``: instead, the hit rates of the
rule and of LRU at the 8 points of both workloads' curves (chat and agentic), packed as
``--sweep-disk`` runs them, with windows apart, and the experiment.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reference.disk_economics import BudgetedIndex, _start, miss_ratio_curve, scaled  # noqa: E402
from reference.economics import MILLION, hashed  # noqa: E402
from reference.eviction import Disk, EvictionRule, Layout, Overflow  # noqa: E402
from reference.keys import split_key  # noqa: E402
from reference.knobs import Chunking  # noqa: E402
from reference.plan import Policy  # noqa: E402
from reference.workload import Workload, requests  # noqa: E402

MODELS = {
    "gemma": ("vllm_adapter/models/gemma-4-31B-it", 2),
    "dsv4": ("vllm_adapter/models/DeepSeek-V4-Flash", 4),
}


def cli_inputs(model: str, tp: int, workload: str) -> tuple[Chunking, Workload, Policy, dict[int, int]]:
    """What ``python -m vllm_adapter config --model M -tp N --block-size 512 --workload W
    --sweep-disk`` hands :func:`vllm_adapter.cli.disk.disk_tier`: the chunking, the
    workload, the release's policy and the bytes per key."""
    import vllm_adapter.cli.sizing as sizing
    from vllm_adapter.cli import main

    got: list[tuple[Chunking, Workload, Policy, dict[int, int]]] = []

    def capture(chunking: Chunking, workload: Workload, policy: Policy,
                key_bytes: Mapping[int, int], *_: Any, **__: Any) -> None:
        got.append((chunking, workload, policy, dict(key_bytes)))

    real = sizing.disk_tier
    sizing.disk_tier = capture  # type: ignore[assignment]
    try:
        err = io.StringIO()
        rc = main(["config", "--model", str(ROOT / model), "-tp", str(tp), "--block-size", "512",
                   "--workload", workload, "--sweep-disk"], stdout=io.StringIO(), stderr=err)
    finally:
        sizing.disk_tier = real  # type: ignore[assignment]
    if rc or not got:
        raise SystemExit(f"the CLI failed for {model}: {err.getvalue()}")
    return got[0]


class InteriorWindowsFirst(Disk):
    """The rule, evicting first a unit of window files only whose boundaries each have a
    full-attention key with a child on disk (the prefix goes on past them: a hit ends there
    only if everything after it is lost); then the rule's order.  An experiment: it scans
    every unit per eviction (slow on large disks)."""

    def _next_unit(self) -> tuple[int, ...] | None:
        s = self.structure
        for fid in self._recency:  # least recently used first
            keys = self.files[fid].keys
            if any(s.is_full(k) for k in keys):
                continue
            boundaries = {b for k in keys for b in s.serves.get(k, ())}
            if not all(any(c in self.file_of for k in s.full_at[b] for c in s.children.get(k, ()))
                       for b in boundaries):
                continue
            unit = self.unit(fid)
            if unit is not None and not any(
                    s.is_full(k) for other in unit for k in self.files[other].keys):
                return unit
        return super()._next_unit()


class ExperimentIndex(BudgetedIndex):
    """The rule with windows apart over :class:`InteriorWindowsFirst`."""

    def __init__(self, chunking: Chunking, key_bytes: Mapping[int, int] | int, budget: int,
                 rule: EvictionRule = EvictionRule.REACHABLE, layout: Layout = Layout.PACKED,
                 *args: Any, **options: Any) -> None:
        super().__init__(chunking, key_bytes, budget, EvictionRule.REACHABLE, Layout.PACKED,
                         *args, windows_apart=True)
        self.disk = InteriorWindowsFirst(self.structure)


def experiment_index(chunking: Chunking, key_bytes: Mapping[int, int], size: int,
                     policy: Policy) -> BudgetedIndex:
    return ExperimentIndex(chunking, key_bytes, size, EvictionRule.REACHABLE, Layout.PACKED,
                           policy.window)


@dataclass(frozen=True)
class Row:
    variant: str
    hit_rate: float
    stores_refused: int
    keys_dropped: int
    stores_cut: int
    recomputed_per_million: float
    stranded_bytes: int
    bytes_on_disk: int
    stuck_windows: float
    reconnected_tokens: float
    """Share of prompt tokens served from full-attention keys stranded after an earlier request."""


def serve(chunking: Chunking, big: Workload, policy: Policy, key_bytes: dict[int, int],
          size: int, served_unbounded: int, variant: str, rule: EvictionRule,
          layout: Layout = Layout.PACKED, experiment: bool = False, **options: Any) -> Row:
    reqs = hashed(list(requests(big)), chunking.tokens_per_hash)
    index = (experiment_index(chunking, key_bytes, size, policy) if experiment else
             BudgetedIndex(chunking, key_bytes, size, rule, layout, policy.window, **options))
    engine = _start(chunking, policy, big.max_num_batched_tokens, index)
    span = {gc.group.index: gc.tokens_per_chunk for gc in chunking.groups}
    full = {gc.group.index for gc in chunking.groups if gc.window_in_chunks is None}
    was_stranded: set[bytes] = set()
    reconnected = 0
    load = index.prepare_load

    def counted_load(keys: Any) -> object:
        nonlocal reconnected
        reconnected += sum(span[split_key(k)[1]] for k in keys
                           if split_key(k)[1] in full and k in was_stranded)
        return load(keys)

    index.prepare_load = counted_load  # type: ignore[method-assign]
    stuck: list[float] = []
    for req, chain in reqs:
        index.observe(chain)
        engine.serve(req, chain)
        disk = index.disk
        if rule is EvictionRule.LRU:
            was_stranded |= disk.stranded()
        if disk.bytes >= 0.9 * size:
            s = index.structure
            stuck.append(sum(
                key_bytes[split_key(k)[1]]
                for fid, f in disk.files.items() if disk._dependents[fid]
                for k in f.keys if not s.is_full(k)) / disk.bytes)
    t = engine.tally
    return Row(
        variant, t.offload_hit / t.prompt_tokens, index.stores_refused, index.keys_dropped,
        index.stores_cut,
        (served_unbounded - t.gpu_hit - t.offload_hit) * MILLION / t.prompt_tokens,
        index.stranded_bytes(), index.disk.bytes, sum(stuck) / len(stuck) if stuck else 0.0,
        reconnected / t.prompt_tokens,
    )


def table(name: str, chunking: Chunking, workload: Workload, policy: Policy,
          key_bytes: dict[int, int], point: int) -> str:
    big = scaled(workload)
    curve = miss_ratio_curve(chunking, big, 8, EvictionRule.REACHABLE, key_bytes, Layout.PACKED,
                             policy)
    size = curve[point - 1].budget_bytes
    assert size is not None
    unbounded = miss_ratio_curve(chunking, big, (2**62,), EvictionRule.REACHABLE, key_bytes,
                                 Layout.PACKED, policy)[0]
    served = round(unbounded.hit_rate * unbounded.prompt_tokens)
    rows = []
    for rule in EvictionRule:
        for admission in (True, False):
            for overflow in Overflow:
                label = (f"{'rule (leaves first)' if rule is EvictionRule.REACHABLE else 'LRU'}, "
                         f"admission {'on' if admission else 'off'}, "
                         f"{'refused whole' if overflow is Overflow.REFUSE else 'head admitted'}")
                rows.append(serve(chunking, big, policy, key_bytes, size, served, label, rule,
                                  admission=admission, overflow=overflow))
    for rule in EvictionRule:
        short = "rule" if rule is EvictionRule.REACHABLE else "LRU"
        rows.append(serve(chunking, big, policy, key_bytes, size, served,
                          f"{short}, windows in a file of their own", rule, windows_apart=True))
        rows.append(serve(chunking, big, policy, key_bytes, size, served,
                          f"{short}, one file per key (per_chunk)", rule, Layout.PER_CHUNK))
    rows.append(serve(chunking, big, policy, key_bytes, size, served,
                      "experiment: rule, windows apart, interior windows first",
                      EvictionRule.REACHABLE, experiment=True))
    gib = 2**30
    out = [
        f"### {name}: {big.name}, point {point} of 8: {size} bytes ({size / gib:.2f} GiB)",
        "",
        "| variant | hit rate | stores refused | keys dropped | stores cut | recomputed for "
        "space/1M | stranded | on disk | window sections in non-leaf files | served from "
        "once-stranded keys |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.variant} | {r.hit_rate:.1%} | {r.stores_refused} | {r.keys_dropped} | "
            f"{r.stores_cut} | {r.recomputed_per_million:,.0f} | {r.stranded_bytes / gib:.2f} GiB | "
            f"{r.bytes_on_disk / gib:.2f} GiB | {r.stuck_windows:.0%} | {r.reconnected_tokens:.1%} |")
    return "\n".join(out)


def curves(name: str, chunking: Chunking, workload: Workload, policy: Policy,
           key_bytes: dict[int, int]) -> str:
    """Rule and LRU hit rates (and the rule's stranded bytes) at the 8 points of a curve."""
    from reference import disk_economics

    big = scaled(workload)
    rule = miss_ratio_curve(chunking, big, 8, EvictionRule.REACHABLE, key_bytes, Layout.PACKED,
                            policy)
    sizes = [e.budget_bytes or 0 for e in rule]
    lru = miss_ratio_curve(chunking, big, sizes, EvictionRule.LRU, key_bytes, Layout.PACKED, policy)
    apart = {r: miss_ratio_curve(chunking, big, sizes, r, key_bytes, Layout.PACKED, policy,
                                 windows_apart=True) for r in EvictionRule}
    real = disk_economics.BudgetedIndex
    disk_economics.BudgetedIndex = ExperimentIndex  # type: ignore[misc]
    try:
        experiment = miss_ratio_curve(chunking, big, sizes, EvictionRule.REACHABLE, key_bytes,
                                      Layout.PACKED, policy)
    finally:
        disk_economics.BudgetedIndex = real  # type: ignore[misc]
    out = [
        f"### {name}: {big.name}",
        "",
        "| disk | rule | LRU | rule - LRU | apart: rule | apart: LRU | apart: rule - LRU | "
        "experiment | experiment - LRU | experiment - apart LRU | stranded (rule, apart, "
        "experiment) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, size in enumerate(sizes):
        r, lr = rule[i], lru[i]
        ar, al = apart[EvictionRule.REACHABLE][i], apart[EvictionRule.LRU][i]
        x = experiment[i]
        out.append(
            f"| {size / 2**30:.2f} GiB | {r.hit_rate:.1%} | {lr.hit_rate:.1%} | "
            f"{100 * (r.hit_rate - lr.hit_rate):+.1f} | {ar.hit_rate:.1%} | {al.hit_rate:.1%} | "
            f"{100 * (ar.hit_rate - al.hit_rate):+.1f} | {x.hit_rate:.1%} | "
            f"{100 * (x.hit_rate - lr.hit_rate):+.1f} | {100 * (x.hit_rate - al.hit_rate):+.1f} | "
            f"{r.stranded_bytes}, {ar.stranded_bytes}, {x.stranded_bytes} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", type=int, default=2, choices=range(1, 9))
    parser.add_argument("--workload", default="agentic")
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--curves", action="store_true")
    args = parser.parse_args()
    for name in args.model or sorted(MODELS, reverse=True):
        model, tp = MODELS[name]
        if args.curves:
            for workload in ("chat", "agentic"):
                inputs = cli_inputs(model, tp, workload)
                print(curves(f"{Path(model).name} TP{tp}", *inputs))
                print(flush=True)
            continue
        chunking, workload, policy, key_bytes = cli_inputs(model, tp, args.workload)
        print(table(f"{Path(model).name} TP{tp}", chunking, workload, policy, key_bytes,
                    args.point))
        print(flush=True)


if __name__ == "__main__":
    main()
