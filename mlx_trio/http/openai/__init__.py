"""The OpenAI wire APIs: chat and text completions, their request parsing, renderer, objects, chunks and logprobs."""
