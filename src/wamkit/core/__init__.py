"""Bottom layer: value types, typed-config helpers, errors and version records shared by every layer."""
