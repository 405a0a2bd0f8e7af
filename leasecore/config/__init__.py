"""The configuration: the key table as data (``keys``), the TOML file (``tomlfile``), the files the
server settings point at (``trust``), and the loader (``loader``) that merges flags, environment,
file and defaults with a source on every value. Everything here runs before anything is polled; a
bad value is a ``ConfigError`` (exit 3) naming the key and its source.
"""
