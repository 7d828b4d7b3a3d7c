"""What every report of the study shares (the sweep, the single benchmarks, the projection, ``advise``): markdown and
CSV tables (``tables``) and the names a strategy variant goes by in them (``variants``). Importing this package
imports none of its modules."""
