"""The ``specbatch`` command line: the only package that prints."""
