"""materializing: see docs/architecture.md."""
