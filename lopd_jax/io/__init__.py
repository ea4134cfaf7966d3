"""Files and paths, local or remote, and the process start-up that picks JAX's platform."""
