"""Platforms shipped with kvtier-core (the CPU reference platform)."""
