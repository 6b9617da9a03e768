"""cascade package (see docs/architecture.md)."""
