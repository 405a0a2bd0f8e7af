"""The configuration, by step: the settings, each option declared once on its field (``settings``),
the checkers of values (``checks``), the key table derived from the declarations (``keys``), the
TOML file (``tomlfile``), the pure merge with its precedence as data and a source on every value
(``merge``), what a reload may change (``live``), the files the server settings point at
(``trust``), and the one loader that does I/O (``loader``). Everything here runs before anything is
polled; a bad value is a ``ConfigError`` (exit 3) naming the key and its source.
"""
