"""The bubblewrap backend: argv building, the backend and cgroups."""
