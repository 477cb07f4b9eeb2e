"""Adapters from serving engines to kvtier. Each engine's package is the only importer of that engine."""
