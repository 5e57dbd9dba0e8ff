"""The golden corpus: vLLM's recorded plan-lane answers as data any backend replays.

Each line of ``data/vllm-<release>.jsonl`` is one case: a geometry, a knob, the
policy switches of the release, the scheduler-side hook calls vLLM's real
scheduler made in order, and the answers its connector gave (hit tokens, load
jobs, store jobs).  Replaying needs only ``reference/`` and the backend, never
vLLM: ``python -m conformance.corpus replay --backend module:object``.  The
format is documented in ``conformance/PROTOCOL.md`` ("Golden corpus") and
``schema.json``; the cases and which rule each covers in ``README.md``.

Modules: :mod:`.codec` (records <-> JSON), :mod:`.format` (a case line, the
schema), :mod:`.cases` (what is run), :mod:`.coverage` (rules reached),
:mod:`.generate` (runs vLLM), :mod:`.run` (replay and compare).
"""
