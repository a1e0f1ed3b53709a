"""What a run may be asked to do: the typed schemas, the startup checks, and a builder's options."""
