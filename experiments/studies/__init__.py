"""One-off measurements behind settings and figures of the proofs (README.md)."""
