"""Derive KV-cache geometry fixtures by running the installed vLLM's own planning on CPU.

One set per vLLM release (0.33.0, 0.34.0): see :mod:`vllm_adapter.fixtures`.

:func:`derive_live` builds, for one :class:`Recipe` (:func:`derive`: the stored fixture
of that name, from :data:`RECIPES`):

1. a real ``VllmConfig`` (``ModelConfig`` from a ``config.json``-only dir under
   ``vllm_adapter/models``, the recipe's engine args, the stock
   ``OffloadingConnector`` as KV-transfer config);
2. the per-layer ``KVCacheSpec``\\ s of one TP rank:

   * **model recipes**: the model's KV-cache layers are instantiated the way the
     model's ``__init__`` would at that TP size (real vLLM layer classes where
     they can be built on CPU, stand-ins carrying the attributes
     ``get_kv_cache_spec`` reads where they cannot), registered in
     ``static_forward_context`` in construction order; vLLM's
     ``Platform.update_block_size_for_backend`` then runs (as the executor does
     after ``load_model``), and the GPU model runner's own ``get_kv_cache_spec``
     collects the specs (``get_kv_cache_spec`` of each layer +
     ``customize_attention_spec`` with the layer's backend);
   * **synthetic recipes**: hand-built with vLLM's spec classes, passed through
     ``customize_attention_spec`` with ``FlashAttentionBackend``;

3. vLLM's engine-core KV-cache init, unmodified: ``EngineCore._initialize_kv_caches``
   called unbound on a stand-in engine core whose executor reports those specs
   for every TP rank and an assumed per-GPU KV budget.  That runs
   ``resolve_kv_cache_layout``, ``get_global_kv_cache_groups`` (grouping, page
   unification, packing), ``get_kv_cache_configs``,
   ``generate_scheduler_kv_cache_config``, the ``cache_config.block_size``
   update, ``resolve_kv_cache_block_sizes`` and
   ``resolve_cache_hit_alignment_tokens``;

4. the result, serialized with :mod:`vllm_adapter.codec`.

Every deviation from a GPU host is listed in the fixture's ``provenance`` and
``cpu_patches`` fields; the platform patch is scoped to the ``VllmConfig``
construction (:func:`vllm_adapter.codec.cpu_platform_patches`).
``num_blocks`` depends only on the assumed KV budget (40 GiB per GPU for Gemma,
60 GiB for DeepSeek-V4, 1 GiB for the synthetic ones): illustrative only.

Modules: :mod:`.recipes` (what to derive), :mod:`.gemma4` / :mod:`.dsv4` (the
models' layers), :mod:`.engine` (runner and engine-core stand-ins), :mod:`.live`
(the steps above), :mod:`.probes` (variants of a rejected geometry).
"""

from vllm_adapter.derive.live import Derivation, derive, derive_live
from vllm_adapter.derive.recipes import RECIPES, Recipe

__all__ = ["RECIPES", "Derivation", "Recipe", "derive", "derive_live"]
