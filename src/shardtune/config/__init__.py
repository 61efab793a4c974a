"""Recipes: the typed schema, loading with key=value overrides, config-only validation."""
