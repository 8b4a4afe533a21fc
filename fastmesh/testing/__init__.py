"""Test and example models (not part of the op contract)."""
