"""planning: see docs/architecture.md."""
