"""A run's own files and processes, apart from the wire: its config, its directory, how its
processes live and die (lifecycle), their heartbeat files and their timeline spans. No MLX
and no sockets here; every other package may import it."""
