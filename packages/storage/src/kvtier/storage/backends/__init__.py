"""Storage backends. Each is registered in the ``kvtier.backends`` entry-point group."""
