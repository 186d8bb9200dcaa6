"""pipec package."""
