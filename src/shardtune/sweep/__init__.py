"""Short real runs over a grid of settings."""
