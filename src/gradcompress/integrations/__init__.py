"""Integrations with training frameworks that are optional dependencies (import the submodule you need).

* :mod:`gradcompress.integrations.lightning`: ``CompressedDDPStrategy`` for Lightning (``pip install
  gradcompress[lightning]``).
"""
