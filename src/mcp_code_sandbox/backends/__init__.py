"""Backends: how sandboxes are started, connected to, stopped and listed."""
