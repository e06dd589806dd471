"""Loading targets and drafts: model specs and the Hugging Face loader, what a path holds, the draft interface,
the EAGLE-style feature draft, the head's input features and batched sampling from one model."""
