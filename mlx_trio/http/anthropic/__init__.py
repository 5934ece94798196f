"""The Anthropic Messages wire API: request parsing, renderer, message objects and stream events."""
