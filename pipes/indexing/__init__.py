"""indexing: see docs/architecture.md."""
