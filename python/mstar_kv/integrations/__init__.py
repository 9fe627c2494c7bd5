"""Integrations of mstar_kv into inference engines (each imports its engine lazily)."""
