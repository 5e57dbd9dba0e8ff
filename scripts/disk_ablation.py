"""The eviction rule against plain LRU on a small disk, and what each part of it costs (issue #31).

At the second point of ``--sweep-disk`` (a quarter of the unbounded run's peak bytes) of the
agentic workload, ``block_size`` 512, gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4, serve the
scaled workload (:func:`reference.disk_economics.scaled`, GPU cache cold, no CPU tier, as
``--sweep-disk`` does) over a :class:`reference.disk_economics.BudgetedIndex` for each of

* eviction {the rule, plain LRU} x admission {on, off} x a store that does not fit {refused
  whole, the longest prefix-closed head admitted} (the index's options), on the packed
  layout as the tier writes it (per store job, its full-attention keys in one file and its
  window keys in another: ``reference.packed.store_job_files``, ``windows_apart``);
* the rule without its first step (passed boundaries' window files first: recency only);
* both rules on the layout before #31, one file per store job (``windows_apart=False``),
  and on one file per key (``per_chunk``);

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
``--sweep-disk`` runs them (the tier's layout, windows apart), beside the rule without its
first step and both on one file per store job (``reports/disk-curves.md`` is this output).
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


def cli_tiered_inputs(model: str, tp: int, workload: str, cpu_bytes: str,
                      ) -> tuple[Chunking, Workload, Policy, dict[int, int], int, Any]:
    """:func:`cli_inputs` of ``--sweep-disk --cpu-bytes cpu_bytes``, with the CPU tier's chunk
    slots and the tier's load split the CLI hands ``disk_tier``."""
    import vllm_adapter.cli.sizing as sizing
    from vllm_adapter.cli import main

    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(*args: Any, **kwargs: Any) -> None:
        got.append((args, kwargs))

    real = sizing.disk_tier
    sizing.disk_tier = capture  # type: ignore[assignment]
    try:
        err = io.StringIO()
        rc = main(["config", "--model", str(ROOT / model), "-tp", str(tp), "--block-size", "512",
                   "--workload", workload, "--cpu-bytes", cpu_bytes, "--sweep-disk"],
                  stdout=io.StringIO(), stderr=err)
    finally:
        sizing.disk_tier = real  # type: ignore[assignment]
    if rc or not got:
        raise SystemExit(f"the CLI failed for {model}: {err.getvalue()}")
    (args, kwargs), = got
    chunking, work, policy, key_bytes = args[:4]
    return chunking, work, policy, dict(key_bytes), kwargs["cpu_chunks"], kwargs["load_split"]


def repair_curves(name: str, model: str, tp: int, workload: str, cpu_bytes: str,
                  ) -> tuple[str, str]:
    """The ``--sweep-disk`` curve with vLLM's CPU tier in front (``--cpu-bytes``), at its 8
    points: the rule, the rule with repair (the cascade also writes a store's missing
    ancestors the CPU tier holds: :meth:`reference.tiered_index.TieredIndex.missing_ancestors`)
    and plain LRU: hit rate, bytes the disk wrote (repairs included), bytes stranded.  Also
    a one-row summary for ``docs/semantics.md`` section 10 (:func:`repair_region`)."""
    from reference.tiered_curve import tiered_miss_ratio_curve

    chunking, work, policy, key_bytes, slots, split = cli_tiered_inputs(model, tp, workload,
                                                                       cpu_bytes)
    big = scaled(work, gpu_cache=work.gpu_cache)
    alone = miss_ratio_curve(chunking, big, 8, EvictionRule.REACHABLE, key_bytes, Layout.PACKED,
                             policy, load_split=split, gpu_cache=big.gpu_cache)
    sizes = tuple(e.budget_bytes or 0 for e in alone)

    def tiered(rule: EvictionRule, repair: bool = False) -> Any:
        return tiered_miss_ratio_curve(chunking, big, sizes, slots, rule, key_bytes,
                                       Layout.PACKED, policy, load_split=split,
                                       gpu_cache=big.gpu_cache, repair=repair)

    rule, fixed, lru = tiered(EvictionRule.REACHABLE), tiered(EvictionRule.REACHABLE, True), \
        tiered(EvictionRule.LRU)
    gib = 2**30
    out = [f"### {name}: {big.name}, CPU tier {cpu_bytes} ({slots} chunk slots)", "",
           "| disk | rule | rule + repair | LRU | repair - rule | GiB written: rule | "
           "rule + repair (of which repairs) | LRU | stranded: rule / rule + repair / LRU |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, r, f, lr in zip(sizes, rule, fixed, lru, strict=True):
        out.append(
            f"| {size / gib:.2f} GiB | {r.hit_rate:.1%} | {f.hit_rate:.1%} | {lr.hit_rate:.1%} | "
            f"{100 * (f.hit_rate - r.hit_rate):+.1f} | {r.bytes_written / gib:.2f} | "
            f"{f.bytes_written / gib:.2f} ({f.bytes_repaired / gib:.2f}) | "
            f"{lr.bytes_written / gib:.2f} | {r.stranded_bytes / gib:.2f} / "
            f"{f.stranded_bytes / gib:.2f} / {lr.stranded_bytes / gib:.2f} GiB |")
    deltas = [100 * (f.hit_rate - r.hit_rate) for r, f in zip(rule, fixed, strict=True)]
    worst = min(range(len(sizes)), key=lambda i: (round(deltas[i], 1), i))
    r, f = rule[worst], fixed[worst]
    summary = (
        f"| {name} {work.name} | {sum(round(d, 1) < 0 for d in deltas)} / "
        f"{sum(round(d, 1) > 0 for d in deltas)} | {deltas[worst]:+.1f} at "
        f"{sizes[worst] / gib:.2f} GiB ({r.hit_rate:.1%} to {f.hit_rate:.1%}) | "
        f"{r.bytes_written / gib:.2f} to {f.bytes_written / gib:.2f} GiB | "
        f"{max(e.stranded_bytes for e in fixed) / gib:.2f} GiB |")
    return "\n".join(out), summary


REPAIR_REGION = "disk-repair"
"""The region of ``docs/semantics.md`` section 10 that ``--repair --doc`` writes."""


def repair_region(summaries: list[str]) -> str:
    """Section 10's summary of ``--repair``: a row per curve."""
    return "\n".join([
        "", "`KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 .nox/tests-vllm-0-34-0/bin/python "
        "scripts/disk_ablation.py --repair` prints the four curves point by point (`--repair "
        "--doc` writes this summary, `--repair --check` reruns it); repair against the rule "
        "without it, CPU tier in front:", "",
        "| curve | points behind / ahead | worst (disk: rule to rule + repair) | written there "
        "(rule to rule + repair) | stranded with repair (max) |",
        "|---|---:|---:|---:|---:|", *summaries, ""])


class RecencyOnly(Disk):
    """The rule without its first step (the window files of a boundary one prefix passed,
    first): least recently used evictable unit only, as before issue #31's fix."""

    passed_windows_first = False


class RecencyOnlyIndex(BudgetedIndex):
    """:class:`BudgetedIndex` over :class:`RecencyOnly` (an ablation)."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.disk = RecencyOnly(self.structure)


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
          layout: Layout = Layout.PACKED, recency_only: bool = False, **options: Any) -> Row:
    reqs = hashed(list(requests(big)), chunking.tokens_per_hash)
    index = (RecencyOnlyIndex if recency_only else BudgetedIndex)(
        chunking, key_bytes, size, rule, layout, policy.window, **options)
    engine = _start(chunking, policy, big.max_num_batched_tokens, index)
    span = {gc.group.index: gc.tokens_per_chunk for gc in chunking.groups}
    full = chunking.full_groups
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
    rows.append(serve(chunking, big, policy, key_bytes, size, served,
                      "rule, recency only (no passed windows first)", EvictionRule.REACHABLE,
                      recency_only=True))
    for rule in EvictionRule:
        short = "rule" if rule is EvictionRule.REACHABLE else "LRU"
        rows.append(serve(chunking, big, policy, key_bytes, size, served,
                          f"{short}, one file per store job (before #31)", rule,
                          windows_apart=False))
        rows.append(serve(chunking, big, policy, key_bytes, size, served,
                          f"{short}, one file per key (per_chunk)", rule, Layout.PER_CHUNK))
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
    """The rule's and LRU's hit rates at the 8 points of a ``--sweep-disk`` curve, on the
    packed layout as the tier writes it (windows apart, ``store_job_files``: a
    full-attention and a window file per job) and on one file per store job (the layout
    before #31), beside the rule without its first step; the rule's stranded bytes."""
    from reference import disk_economics

    big = scaled(workload)
    rule = miss_ratio_curve(chunking, big, 8, EvictionRule.REACHABLE, key_bytes, Layout.PACKED,
                            policy)
    sizes = [e.budget_bytes or 0 for e in rule]
    lru = miss_ratio_curve(chunking, big, sizes, EvictionRule.LRU, key_bytes, Layout.PACKED, policy)
    joined = {r: miss_ratio_curve(chunking, big, sizes, r, key_bytes, Layout.PACKED, policy,
                                  windows_apart=False) for r in EvictionRule}
    real = disk_economics.BudgetedIndex
    disk_economics.BudgetedIndex = RecencyOnlyIndex  # type: ignore[misc]
    try:
        recency = miss_ratio_curve(chunking, big, sizes, EvictionRule.REACHABLE, key_bytes,
                                   Layout.PACKED, policy)
    finally:
        disk_economics.BudgetedIndex = real  # type: ignore[misc]
    out = [
        f"### {name}: {big.name}",
        "",
        "| disk | rule | LRU | rule - LRU | rule, recency only | one file per job: rule | "
        "one file per job: LRU | one file per job: rule - LRU | rule - LRU one file per job | "
        "stranded (rule, one file per job: rule) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, size in enumerate(sizes):
        r, lr = rule[i], lru[i]
        jr, jl = joined[EvictionRule.REACHABLE][i], joined[EvictionRule.LRU][i]
        out.append(
            f"| {size / 2**30:.2f} GiB | {r.hit_rate:.1%} | {lr.hit_rate:.1%} | "
            f"{100 * (r.hit_rate - lr.hit_rate):+.1f} | {recency[i].hit_rate:.1%} | "
            f"{jr.hit_rate:.1%} | {jl.hit_rate:.1%} | {100 * (jr.hit_rate - jl.hit_rate):+.1f} | "
            f"{100 * (r.hit_rate - jl.hit_rate):+.1f} | {r.stranded_bytes}, {jr.stranded_bytes} |")
    return "\n".join(out)


DOC = ROOT / "docs" / "semantics.md"
DOC_NAME = "docs/semantics.md"
REGION = "disk-ablation"
"""The region of ``docs/semantics.md`` section 10 that :func:`doc` writes."""


def doc_region() -> str:
    """The default ablation (point 2 of the agentic curve, both models) as section 10 shows
    it: the command, then a table per model."""
    body = ["", "`KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 .nox/tests-vllm-0-34-0/bin/python "
            "scripts/disk_ablation.py --doc` (`--check` reruns it); hit rate = prompt tokens "
            "served from disk; per variant: stores refused, keys dropped by admission, stores "
            "cut to a head, tokens recomputed for lack of space per million prompt tokens, "
            "bytes stranded and on disk at the end:", ""]
    for name in sorted(MODELS, reverse=True):
        model, tp = MODELS[name]
        chunking, workload, policy, key_bytes = cli_inputs(model, tp, "agentic")
        body += ["#" + table(f"{Path(model).name} TP{tp}", chunking, workload, policy,
                             key_bytes, 2), ""]
    return "\n".join(body)


def doc(check: bool, region: str = REGION, body: str | None = None) -> int:
    """Write (or with ``check`` compare) the ``region`` of section 10 (``body``: its text;
    None: the ablation, :func:`doc_region`)."""
    import re

    text = DOC.read_text()
    pattern = re.compile(rf"(<!-- generated:{region} -->)(.*?)(<!-- /generated:{region} -->)", re.S)
    if not pattern.search(text):
        print(f"{DOC_NAME} has no <!-- generated:{region} --> region: add the markers")
        return 1
    fresh = doc_region() if body is None else body
    new = pattern.sub(lambda m: m[1] + fresh + m[3], text, count=1)
    if check:
        same = new == text
        print(f"{DOC_NAME} section 10's {region}: {'current' if same else 'differs'}")
        return 0 if same else 1
    DOC.write_text(new)
    print(f"wrote {DOC_NAME} section 10's {region}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", type=int, default=2, choices=range(1, 9))
    parser.add_argument("--workload", default="agentic")
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--curves", action="store_true")
    parser.add_argument("--repair", action="store_true",
                        help="the four --sweep-disk --cpu-bytes curves (scripts/disk_curves_cpu.py"
                        "'s): the rule, the rule with repair, plain LRU, CPU tier in front")
    parser.add_argument("--doc", action="store_true",
                        help=f"write the default ablation (both models) into {DOC_NAME} section 10")
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 when {DOC_NAME} section 10's ablation differs from a fresh run")
    args = parser.parse_args()
    if (args.doc or args.check) and not args.repair:
        raise SystemExit(doc(args.check))
    if args.repair:
        from scripts.disk_curves_cpu import CURVES

        quiet = args.doc or args.check
        summaries = []
        if not quiet:
            print("# Repair: the cascade writes a store's missing ancestors from the CPU tier\n\n"
                  "Generated by `KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 .nox/tests-vllm-0-34-0/bin/python "
                  "scripts/disk_ablation.py --repair` (`block_size` 512, packed layout, GPU prefix "
                  "cache cold, vLLM's CPU tier in front of the disk as `--sweep-disk --cpu-bytes` "
                  "serves it, `reference/tiered_curve.py`; hit rate = prompt tokens the offload tiers "
                  "served; written = bytes of the files the disk wrote; stranded = bytes on disk at "
                  "the end no lookup can load from the disk alone).\n")
        for c in CURVES:
            if args.model and not any(MODELS[m][0].endswith(c.model) for m in args.model):
                continue
            table, summary = repair_curves(f"{c.model} TP{c.tp}", f"vllm_adapter/models/{c.model}",
                                           c.tp, c.workload, c.cpu_bytes)
            summaries.append(summary)
            if not quiet:
                print(table)
                print(flush=True)
        if quiet:
            raise SystemExit(doc(args.check, REPAIR_REGION, repair_region(summaries)))
        return
    if args.curves:
        print("# The eviction rule against plain LRU on the `--sweep-disk` curves\n\n"
              "Generated by `KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 .nox/tests-vllm-0-34-0/bin/python "
              "scripts/disk_ablation.py --curves` (`block_size` 512, packed layout as the tier "
              "writes it: each store job's full-attention keys in one file and its window keys "
              "in another (`reference.packed.store_job_files`, `BudgetedIndex(windows_apart="
              "True)`), no CPU tier, GPU cache cold; hit rate = prompt tokens served from disk). "
              "`rule, recency only`: the rule without its first step (passed boundaries' window "
              "files first). `one file per job`: every key of a store job in one file "
              "(`BudgetedIndex(windows_apart=False)`), the tier's layout before issue #31. "
              "`stranded`: the rule's bytes no lookup can load, at the end.\n")
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
