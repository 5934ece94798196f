"""Per-row sampling: samplers and logits processors, grammar masks, logprobs."""
