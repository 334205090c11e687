"""Tools built on the core: ``runner sweep``, ``runner bench`` and ``runner diff``. Nothing in the core imports them."""
