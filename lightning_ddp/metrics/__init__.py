"""What the ``CommTimer`` logs: pure step accounting (``accounting``), the ranks' straggler exchange (``straggler``),
the run's shared ``Recorder`` and the traces' communication track (``recording``). Definitions: ``docs/comm_timer.md``.
"""
