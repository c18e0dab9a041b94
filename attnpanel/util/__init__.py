"""Small tools every layer may use: cancellation, per-key locks, safe writes, untrusted text."""
