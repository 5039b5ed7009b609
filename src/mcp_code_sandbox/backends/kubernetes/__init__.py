"""The kubernetes backend: a pod per session (see backend.py)."""
