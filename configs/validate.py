"""Config errors that launch.py reports in one line: `ConfigError`."""


class ConfigError(ValueError):
  """A config (or command line) that cannot run; launch.py prints its message without a
  traceback and exits with code 2."""
