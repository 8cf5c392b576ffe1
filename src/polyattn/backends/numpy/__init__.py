"""The NumPy fast path (``"chunked"`` on NumPy arrays): blocks on a thread pool."""
