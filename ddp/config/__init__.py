"""What a run may be asked to do: the typed schemas, the startup checks of its values, and a builder's options."""
