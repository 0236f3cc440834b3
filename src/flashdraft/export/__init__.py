"""Engine-ready checkpoint layouts (z-lab, vLLM speculators)."""
