"""`switchyard serve`: the whole local stack from one YAML."""
