"""The label that means "no loss here": every masked token (prompts, padding, document starts) carries it.

-100 is the value PyTorch's cross_entropy ignores by default and transformers' models use, so our labels mean
the same thing to them as to our fused loss.
"""

IGNORE_INDEX = -100
