"""The SmolLM2-135M-Instruct proof: DFlash on a real pretrained chat model (README.md)."""
