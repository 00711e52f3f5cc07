"""One module per model family (the architecture registry's building blocks)."""
