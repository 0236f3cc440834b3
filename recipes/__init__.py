"""Recipes built on flashdraft and kept out of the installed package: the GPU proofs and their
scales (`recipes.proof` for a target trained here, `recipes.smollm2` for SmolLM2-135M-Instruct), run by
the scripts under scripts/. What they measured is in docs/results.md."""
