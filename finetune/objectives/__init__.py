"""What is optimized: the objective seam (base.py) and its implementations (SFT, DPO, ORPO), the per-pair
preference losses as pure functions (pair_losses.py), and the DPO reference's log-probabilities (reference.py)."""
