"""The ``spiffy`` command line."""
