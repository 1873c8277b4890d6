"""Small helpers shared across layers (tiny offline models for tests and the demo)."""
