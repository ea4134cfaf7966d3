"""A run's settings: the config schema and its section dataclasses, the command-line
overrides, the saved run config, the arms, the ``lengths`` section, task-data checks and the
configuration error."""
