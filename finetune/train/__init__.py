"""Training: what a run needs before its first step (setup.py), the loop (loop.py), one optimizer step on the
device (step.py), eval (evaluate.py), the optimizer and schedule (optim.py), DDP/FSDP2 wrapping (parallel.py), the
step plan checked against the data (plan.py). Only the CLI and the commands import it, lazily."""
