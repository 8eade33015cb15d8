"""A run on disk: the run directory's layout and readers (directory.py), resumable checkpoints (checkpoint.py), and
a finished run's model for eval, generate and merge (trained.py)."""
