"""Test support: tiny processors and models of the families, shared helpers (not shipped)."""
