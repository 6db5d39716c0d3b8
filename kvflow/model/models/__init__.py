"""The transformer definitions: Llama, Qwen2, Qwen3 and the layers they share."""
