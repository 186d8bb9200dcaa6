"""passes package."""
