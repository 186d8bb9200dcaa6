"""codegen package."""
