"""Matrix-state recurrences: linear attention and the delta rule, step by step or chunkwise."""
