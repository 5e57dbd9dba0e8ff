"""Where kvchunk touches vLLM.

Every vLLM import lives in :mod:`vllm_adapter.vllm_api` (serving),
:mod:`vllm_adapter.vllm_tools_api` (config tooling, fixture derivation),
:mod:`vllm_adapter.vllm_shims` (release differences) or, for the conformance
suite, :mod:`conformance.harness.vllm_harness_api`.
"""
