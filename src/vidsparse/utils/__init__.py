"""Small shared helpers: backend choice, device queries, argument checks."""
