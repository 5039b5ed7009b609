"""The Docker backend: container specs, the engine, the backend, sandboxes, runners."""
