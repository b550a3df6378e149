"""Small shared helpers: backend choice, device queries, argument checks."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, without floats."""
    return -(-a // b)
