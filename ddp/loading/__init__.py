"""The data's way into a rank: samplers, loaders and the DataLoader workers."""
