"""Bundled config.json files of popular models (no weights)."""
