"""A notebook kernel whose code runs inside a forkd sandbox (see its issue)."""
