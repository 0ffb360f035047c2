"""reading: see docs/architecture.md."""
