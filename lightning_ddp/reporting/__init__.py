"""What every report of the study shares (the sweep, the single benchmarks, the projection, ``advise``): markdown and
CSV tables (``tables``), the names a strategy variant goes by in them (``variants``) and where a result came from
(``provenance``). Importing this package imports none of its modules."""
