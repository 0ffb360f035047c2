"""command: see docs/architecture.md."""
