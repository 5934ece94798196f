"""The prompt cache: the RAM tier, and the SSD tier's host copies, files and identity."""
