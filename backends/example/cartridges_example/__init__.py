"""cartridges-example: a plugin to copy. Nothing heavy happens at import; the SDK imports the classes by name."""
