"""IPython magics for forkd (see the notebook front-end issue)."""
