"""The OpenAI wire APIs: chat and text completions, their request parsing, objects, chunks and logprobs."""
