"""The HF transformers static-batch baseline's input: one left-padded batch and its mask."""
import torch


def left_pad(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, width) for generate(); prompts are right-aligned."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, p in enumerate(batch):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask, width
