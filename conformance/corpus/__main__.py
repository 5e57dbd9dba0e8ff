"""``python -m conformance.corpus replay|generate|check|schema``.

``replay --backend module:object [--corpus PATH ...] [--trace-lines N]``
    Replays every case into the backend (``reference`` or ``module:object``) and
    compares its answers with vLLM's.  Needs only ``reference/`` and the backend:
    no vLLM.  Default corpus: every committed file (``data/vllm-*.jsonl``).  Each
    failed case prints a report (:mod:`conformance.corpus.run`); the last line
    counts the cases passed and failed and the answers that matched.
``generate [--out PATH]``
    Runs every case on the installed vLLM and writes ``data/vllm-<release>.jsonl``.
``check``
    Regenerates the installed release's corpus in memory and compares it byte for
    byte with the committed file, naming the first case that differs.
``schema [--check]``
    Writes ``schema.json`` from the format's types (``--check``: compare only).
``coverage``
    Prints the case list and which case covers which rule (``README.md`` holds it).

``generate`` and ``check`` run themselves again with ``PYTHONHASHSEED=0``
(:mod:`conformance.corpus.generate` says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conformance.corpus.format import DATA_DIR, SCHEMA_PATH, case_schema, data_path, dumps_schema
from conformance.corpus.run import TRACE_LINES


def _reexec_with_hash_seed(argv: list[str]) -> int | None:
    from conformance.corpus.generate import HASH_SEED

    if os.environ.get("PYTHONHASHSEED") == HASH_SEED:
        return None
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    return subprocess.call([sys.executable, "-m", "conformance.corpus", *argv], env=env)


def _replay(args: argparse.Namespace) -> int:
    from conformance.corpus.format import read_corpus
    from conformance.corpus.run import check_case
    from conformance.protocol.backends import load_backend

    backend = load_backend(args.backend)
    paths = [Path(p) for p in args.corpus] or sorted(DATA_DIR.glob("vllm-*.jsonl"))
    if not paths:
        print(f"no corpus files in {DATA_DIR}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    failed = raised = total = answers = matched = 0
    for path in paths:
        for case in read_corpus(path):
            result = check_case(case, backend, trace_lines=args.trace_lines)
            total += 1
            answers += result.answers
            matched += result.matched
            if result.failure is not None:
                failed += 1
                raised += result.raised
                print(f"FAIL {result.failure}\n")
            elif args.verbose:
                print(f"ok   {case.release} {case.name} ({result.answers} answers)")
    seconds = time.perf_counter() - start
    print(summary_line(backend.name, total, failed, raised, answers, matched, len(paths), seconds))
    return 1 if failed or not total else 0


def summary_line(name: str, total: int, failed: int, raised: int, answers: int, matched: int,
                 files: int, seconds: float) -> str:
    """The replay's last line: cases passed and failed, answers that matched vLLM's."""
    why = f" ({raised} of them raised)" if raised else ""
    return (f"{name}: {total - failed}/{total} cases passed, {failed} failed{why}; "
            f"{matched}/{answers} answers matched vLLM's (a failed case counts those before "
            f"its first divergence); {files} file(s), {seconds:.1f} s")


def _generate(args: argparse.Namespace) -> int:
    from conformance.corpus.generate import generate_text, installed_release

    start = time.perf_counter()
    release = installed_release()
    text = generate_text(release)
    out = Path(args.out) if args.out else data_path(release)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: {text.count(chr(10))} cases, {len(text.encode())} bytes, "
          f"vLLM {release}, {time.perf_counter() - start:.1f} s")
    return 0


def first_difference(committed: str, fresh: str) -> str | None:
    """The first case (by line) whose bytes differ, in words; None when equal."""
    if committed == fresh:
        return None
    old, new = committed.splitlines(), fresh.splitlines()
    for i in range(max(len(old), len(new))):
        a = old[i] if i < len(old) else None
        b = new[i] if i < len(new) else None
        if a != b:
            name = json.loads(b or a or "{}").get("case", "?")
            if a is None or b is None:
                return f"line {i + 1} (case {name!r}) is only in the {'fresh' if a is None else 'committed'} corpus"
            at = next(j for j in range(min(len(a), len(b)) + 1) if j >= min(len(a), len(b)) or a[j] != b[j])
            return (f"line {i + 1}, case {name!r}, differs at character {at}: "
                    f"committed ...{a[max(0, at - 60):at + 60]}... fresh ...{b[max(0, at - 60):at + 60]}...")
    return "the files differ in their line endings"


def _check(args: argparse.Namespace) -> int:
    from conformance.corpus.generate import generate_text, installed_release

    start = time.perf_counter()
    release = installed_release()
    path = data_path(release)
    committed = path.read_text() if path.exists() else ""
    diff = first_difference(committed, generate_text(release))
    seconds = time.perf_counter() - start
    if diff is not None:
        print(f"{path} is not what vLLM {release} generates ({seconds:.1f} s): {diff}\n"
              f"regenerate it: nox -s \"corpus(vllm='{release}')\"", file=sys.stderr)
        return 1
    print(f"{path}: equal to a fresh generation on vLLM {release} ({seconds:.1f} s)")
    return 0


def _coverage(args: argparse.Namespace) -> int:
    from conformance.corpus.coverage import coverage_markdown

    print(coverage_markdown(), end="")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from conformance.corpus.coverage import section8_rules

    text = dumps_schema(case_schema(section8_rules()))
    if args.check:
        if not SCHEMA_PATH.exists() or SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale: python -m conformance.corpus schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay the corpus into a backend (no vLLM needed)")
    rp.add_argument("--backend", default="reference", help="reference or module:object")
    rp.add_argument("--corpus", action="append", default=[], help="a corpus file (repeatable)")
    rp.add_argument("-v", "--verbose", action="store_true")
    rp.add_argument("--trace-lines", type=int, default=TRACE_LINES, metavar="N",
                    help=f"trace lines shown before a failure (default {TRACE_LINES}; 0: all)")
    gp = sub.add_parser("generate", help="run the cases on the installed vLLM, write the file")
    gp.add_argument("--out", help="where to write (default: data/vllm-<release>.jsonl)")
    sub.add_parser("check", help="the committed file equals a fresh generation")
    sub.add_parser("coverage", help="print the case list and coverage map (README.md)")
    sp = sub.add_parser("schema", help="write schema.json from the format's types")
    sp.add_argument("--check", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command in ("generate", "check"):
        code = _reexec_with_hash_seed(argv)
        if code is not None:
            return code
    command = {"replay": _replay, "generate": _generate, "check": _check, "schema": _schema,
               "coverage": _coverage}
    return command[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
