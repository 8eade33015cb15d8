"""The commands beside training: verify (the accumulation proof), generate/chat, merge, plot, runs compare."""
