"""The proof on a Qwen3 target trained here from scratch on real code (README.md)."""
