"""The study: benchmarks as configs of one pipeline (``launch`` starts every fit, ``study`` holds the shared parts;
docs/benchmarks.md). Importing this package imports none of its modules."""
