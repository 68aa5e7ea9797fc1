"""The model's description: `ModelSpec` (every tensor with name, shape, dtype and role, from config.json or
headers), reading checkpoint folders lazily and safely (never unpickling), and the on-disk contract of a
quantkit output folder (file names, quantization method and version) that every reader and writer shares."""
