"""A run on disk: the run directory's layout and readers (directory.py), whose it is and what a new run may do
there (startup.py), the run lock (lock.py), resumable checkpoints (checkpoint.py) verified by their manifest
(manifest.py), directories written atomically (atomic.py), and a finished run's model for eval, generate and merge
(trained.py)."""
