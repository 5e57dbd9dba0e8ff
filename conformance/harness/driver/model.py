"""The fake model: deterministic sampled tokens, no forward pass."""

from __future__ import annotations

import zlib
from typing import Any

from conformance.harness import vllm_harness_api as V

VOCAB_SIZE = 32000
FIRST_SAMPLED_TOKEN = 3  # stay clear of bos/eos


def sampled_token(req_id: str, position: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token the fake model samples for ``req_id`` at sequence ``position``."""
    span = vocab_size - FIRST_SAMPLED_TOKEN
    return FIRST_SAMPLED_TOKEN + (zlib.crc32(req_id.encode()) + 7919 * position) % span


def model_output(scheduler: Any, so: Any, kv_output: Any, vocab_size: int) -> Any:
    """The ``ModelRunnerOutput`` for scheduler output ``so``, carrying ``kv_output``.

    Every scheduled request gets one sampled token, except one mid-prefill
    (``is_prefill_chunk``), which gets none.
    """
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        if req.is_prefill_chunk:
            sampled.append([])
        else:
            sampled.append([sampled_token(req_id, req.num_tokens, vocab_size)])
    return V.model_runner_output(req_ids, sampled, kv_output)
