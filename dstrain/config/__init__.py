"""Configuration: the recipe schema, the world layout, files and overrides, the hub path of a target."""
