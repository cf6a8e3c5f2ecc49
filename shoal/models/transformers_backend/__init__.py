"""The Transformers modeling backend: transformers' own modeling code with shoal's paged
attention plugged in through its attention interface (model.py says how). Modules are
imported where used: support.py's checks need no torch."""
