"""Integrations with other libraries: `hf` (Hugging Face transformers)."""
