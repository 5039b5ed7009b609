"""The bubblewrap backend: argv building, the backend, its network (slirp4netns) and cgroups."""
