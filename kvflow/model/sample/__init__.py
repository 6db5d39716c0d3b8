"""Logits to tokens: the sampler, logits processors, logprobs, the grammar bitmask."""
