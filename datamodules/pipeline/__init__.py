"""What happens to every source: transforms, caching, splitting, rank partitions, data checks."""
