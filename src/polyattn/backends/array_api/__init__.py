"""Attention in Array-API calls only: ``"reference"`` and the blocked ``"chunked"``."""
