"""Resolve: a recipe, its overrides, the quickstart's defaults and the `auto` values turned into one frozen run."""
