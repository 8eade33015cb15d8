"""The loss: the fused linear cross-entropy that never builds the full logits (fused.py: Liger, chunked torch,
naive reference), and per-token log-probabilities through the
same head (logprobs.py)."""
