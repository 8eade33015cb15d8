"""The loss: the fused linear cross-entropy that never builds the full logits (fused.py: chunked torch, Liger, naive
reference; liger.py: Liger-Kernel's calls and Triton's interpreter), and per-token log-probabilities through the
same head (logprobs.py)."""
