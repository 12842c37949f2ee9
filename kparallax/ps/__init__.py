"""Parameter-server side of kparallax: the server process, shared variables and sparse aggregation."""
