"""Proofs and one-off studies built on flashdraft, kept out of the installed package.

Each folder has a README with its question, its command and its latest result. Run them from the
repository root as modules (`python -m experiments.smollm2.proof ...`); the package never imports them.
"""
