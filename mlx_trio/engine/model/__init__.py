"""The model: loading, GGUF conversion, the default model, output markers, detokenized text."""
