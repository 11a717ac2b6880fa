"""Small, readable models and data modules that the configs in ``configs/`` train."""
