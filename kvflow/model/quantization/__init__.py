"""Quantized weights executed as stored: GGUF blocks, or HF weights quantized at load."""
