"""forkd_server: the controller, the registry, the CLI (and later the REST API)."""
