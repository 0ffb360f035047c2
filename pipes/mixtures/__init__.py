"""mixtures: see docs/architecture.md."""
