"""The Anthropic Messages wire API: request parsing, message objects and stream events."""
