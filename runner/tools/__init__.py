"""Tools built on the core: ``runner sweep`` and ``runner bench``. Nothing in the core imports them."""
