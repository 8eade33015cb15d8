"""Context parallelism (distributed.context_parallel, issue 45): each sequence split across N ranks of a torchrun job.
ulysses.py: attention over a sequence-sharded batch, by all-to-all exchanges to head-sharded full sequences and
back (DeepSpeed-Ulysses), around any attention that sees whole sequences (our packed attention included).
A leaf: it imports nothing else of finetune."""
