"""The protocol: trace records and their format, replay into a backend, the invariants,
per-release rules (versions), backends, and the recorded deviations.
"""
