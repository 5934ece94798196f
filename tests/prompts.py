"""Prompts shared by the engine-level tests (batch lane, faults): different lengths, plain English."""

PROMPTS = [
    "Once upon a time there was",
    "The wind over the water",
    "A story about a ship and the sea and the long shore",
    "Hello there",
    "the the the sea sea",
    "Item 4 is a small note",
    "Tell me about the sea.",
    "What is the capital",
]
