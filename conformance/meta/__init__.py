"""The meta lane: mutants of the reference, the adapter and vLLM's side, and the
mutation run that scores which check catches each one by assertion.
"""
