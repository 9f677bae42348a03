"""Deterministic (batch-invariant) kernels with torch reference paths; see kernels/README.md."""
