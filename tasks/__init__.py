"""Tasks: what a model is trained for. Each task module holds its loss, its evaluation sums (one
fixed-size tensor per batch, so exact evaluation is one all_reduce at any world size) and the
metrics computed from those sums."""
