"""The one place kvchunk touches vLLM: every vLLM import lives in :mod:`vllm_adapter.vllm_api`."""
