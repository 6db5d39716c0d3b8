"""Finding, opening and loading checkpoints: HF directories (safetensors) and GGUF files."""
