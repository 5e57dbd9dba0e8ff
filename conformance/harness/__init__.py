"""The harness: drives vLLM's real offloading path (driver, synthetic model runner,
tiers, faults, GPU copy, e2e) and holds the case tables and strategies the lanes draw.
"""
