"""Attention for decode steps of padded batches: a CUDA kernel that reads only each row's own keys, and its routing."""
