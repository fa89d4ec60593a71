"""The HTTP client of the serving benches: httpx2, which the openai client brings from its
version 3 on, or httpx, which earlier versions bring (pyproject allows openai >= 1.40)."""

try:
    import httpx2 as httpx
except ImportError:
    import httpx

__all__ = ["httpx"]
